"""Peer adapters of the moe op."""
