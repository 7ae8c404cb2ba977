"""opmap's mla kernels."""
