"""Backend registrations of the sampling family."""
