"""rope op family."""
