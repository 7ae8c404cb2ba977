"""Backend registrations of the grammar family."""
