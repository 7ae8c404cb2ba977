"""Peer adapters of the activation op."""
