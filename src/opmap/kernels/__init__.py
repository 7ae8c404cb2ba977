"""opmap's own Triton / Gluon kernels: one package per operator family, launchers and their jit helpers only. Kernels import core and their family's definitions in opmap.ops, nothing above."""
