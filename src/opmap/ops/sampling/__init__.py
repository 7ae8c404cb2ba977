"""sampling op family."""
