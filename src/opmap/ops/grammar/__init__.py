"""grammar op family."""
