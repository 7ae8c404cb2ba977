"""Correctness suite: cases per op family, runnable from the CLI (`opmap check`) and pytest."""
