"""opmap's attention kernels."""
