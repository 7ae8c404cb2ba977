"""Backend registrations of the norm family."""
