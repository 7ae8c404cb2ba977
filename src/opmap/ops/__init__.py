"""Op families: one package each (reference, Triton kernels, peer adapters, backends)."""
