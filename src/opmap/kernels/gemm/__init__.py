"""opmap's gemm kernels."""
