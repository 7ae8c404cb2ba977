"""activation op family."""
