"""Check cases, one module per op family (each defines ``cases(device, quick)``)."""
FAMILIES = ("attention", "mla", "norm", "rope", "activation", "gemm", "moe", "sampling", "grammar", "engine")
