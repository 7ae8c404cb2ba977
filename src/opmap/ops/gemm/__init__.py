"""gemm op family."""
