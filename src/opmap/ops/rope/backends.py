"""Backend registrations of the rope family."""
