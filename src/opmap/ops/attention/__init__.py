"""attention op family."""
