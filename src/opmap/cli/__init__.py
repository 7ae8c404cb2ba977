"""The opmap command."""
