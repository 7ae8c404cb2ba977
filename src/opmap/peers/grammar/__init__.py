"""Peer adapters of the grammar op."""
