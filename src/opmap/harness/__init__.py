"""The product around the kernels: check (correctness), bench (speed), profile (traces), report, and what they share (output, plan, fixtures)."""
