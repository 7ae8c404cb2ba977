"""The README's "Use the kernels" example runs as written (on the CPU, in Triton's interpreter)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_use_the_kernels_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use the kernels"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch.Size([2, 8, 64]) torch.Size([2, 8])"
