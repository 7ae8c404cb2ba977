"""opmap's grammar kernels."""
