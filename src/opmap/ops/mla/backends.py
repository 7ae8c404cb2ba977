"""Backend registrations of the mla family."""
