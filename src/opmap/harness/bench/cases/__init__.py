"""Benchmark cases, one module per op family (each defines ``cases(quick)``)."""
FAMILIES = ("attention", "mla", "norm", "rope", "activation", "gemm", "moe", "sampling", "grammar")
