"""opmap's rope kernels."""
