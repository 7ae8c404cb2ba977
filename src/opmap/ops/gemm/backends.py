"""Backend registrations of the gemm family."""
