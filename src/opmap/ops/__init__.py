"""What each operator is, one package per family: its input contract (validate.py), its plain-PyTorch
fp32 reference (reference.py) and the declarations of every backend that serves it (backends.py, which
name their implementations in opmap.kernels and opmap.peers by import strings)."""
