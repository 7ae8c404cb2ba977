"""Backend registrations of the attention family."""
