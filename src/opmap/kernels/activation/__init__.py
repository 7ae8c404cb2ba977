"""opmap's activation kernels."""
