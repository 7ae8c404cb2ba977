"""opmap's sampling kernels."""
