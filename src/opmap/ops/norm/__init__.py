"""norm op family."""
