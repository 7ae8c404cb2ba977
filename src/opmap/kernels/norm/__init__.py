"""opmap's norm kernels."""
