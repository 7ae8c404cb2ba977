"""Adapters of other libraries behind the same op contracts (cuDNN / FlashAttention through PyTorch SDPA, FlexAttention, FlashInfer, cuBLAS through torch, torch loops, XGrammar)."""
