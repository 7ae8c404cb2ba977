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


def _excerpt(after: str) -> list:
    """The lines of the README's code block that follows the text ``after``."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```\n", text.index(after)) + 4
    return text[start:text.index("```", start)].splitlines()


def _opmap(*argv) -> list:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "opmap.cli.main", *argv], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_select_excerpt_is_the_commands_output():
    """Every line the README shows of `opmap select` is a line the command prints, in full (no
    reason cut short); "..." stands for the lines left out."""
    cmd = "opmap select attention --phase decode --heads 32 --kv-heads 8 --head-dim 128 --page-size 16 " \
          "--kv-dtype fp8 --cuda-graph --arch sm90"
    shown = _excerpt(f"`{cmd}`")
    got = _opmap(*cmd.split()[1:])
    assert shown[-1].strip() == "..." and len(shown) > 3
    for line in shown[:-1]:
        assert line in got, line


def test_report_excerpt_is_the_commands_output(tmp_path):
    """The `opmap report --arch sm90` summary in the README is the command's (its timing aside)."""
    shown = _excerpt("`opmap report --model llama3-8b --arch sm90` on a CPU")
    got = _opmap("report", "--model", "llama3-8b", "--arch", "sm90", "--out", str(tmp_path / "r"))
    for line in shown:
        if line != "..." and not line.startswith("wrote "):
            assert line in got, line
