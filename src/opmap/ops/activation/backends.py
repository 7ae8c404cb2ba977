"""Backend registrations of the activation family."""
