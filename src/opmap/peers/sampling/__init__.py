"""Peer adapters of the sampling op."""
