"""Peer adapters of the mla op."""
