"""Backend registrations of the moe family."""
