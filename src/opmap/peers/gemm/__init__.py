"""Peer adapters of the gemm op."""
