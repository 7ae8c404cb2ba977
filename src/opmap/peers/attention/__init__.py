"""Peer adapters of the attention op."""
