"""Peer adapters of the norm op."""
