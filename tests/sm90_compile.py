"""Shared by the sm90 compile tests: they compile Triton kernels for sm90 on this CPU-only
machine (Triton's ahead-of-time path and its bundled ptxas) in a subprocess, because the
interpreter (TRITON_INTERPRET=1) replaces @triton.jit in the test process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def ptxas_available() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


needs_ptxas = pytest.mark.skipif(not ptxas_available(), reason="this Triton wheel has no bundled ptxas")


def run(script: str, timeout: int = 900) -> dict:
    """Run ``script`` (which prints ``RESULT <json>``) without the interpreter; returns the JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])
