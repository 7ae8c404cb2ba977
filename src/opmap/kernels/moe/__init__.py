"""opmap's moe kernels."""
