"""Benchmark harness: cases with FLOPs and minimal bytes, peers timed in the same run."""
