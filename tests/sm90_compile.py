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


# Prepended to every compile script: ``compile_sm90`` builds a kernel for sm90 with Triton's AOT
# path and ``usage`` reads what ptxas made of it (registers, stack and local memory, shared memory)
# and what the TTGIR shows (async copies, their waits, Hopper warpgroup MMAs).
PRELUDE = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, sig, ce, opts, div=()):
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}  # what Triton infers for aligned args
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def usage(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                         capture_output=True, text=True).stdout
    line = " ".join(l for l in out.splitlines() if "REG:" in l)
    fields = dict(t.split(":") for t in line.split() if ":" in t and t.split(":")[1].isdigit())
    tt = k.asm["ttgir"]
    return {"reg": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
            "shared": k.metadata.shared, "async": tt.count("async_copy_global_to_local"),
            "waits": re.findall(r"async_wait[^{]*\{num = (\d+)", tt), "wgmma": tt.count("warp_group_dot ")}


def _sass(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    return subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout


def sass_ops(k):
    # how many of each SASS instruction the build has (cuobjdump -sass; predicates dropped)
    import collections
    return dict(collections.Counter(m.group(1) for m in
                                    re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", _sass(k))))


def compile_gluon_sm90(fn, sig, ce, opts, div=()):
    # a @gluon.jit kernel, as compile_sm90
    from triton.experimental.gluon._runtime import GluonASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def loop_ops(k):
    # how many of each SASS instruction the build's longest loop (its longest backward branch) holds
    import collections
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)([^;]*);", _sass(k))]
    loops = []
    for a, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < a:
            loops.append((int(t.group(1), 16), a))
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return dict(collections.Counter(op for a, op, rest in ins if lo <= a <= hi))
"""


def run(script: str, timeout: int = 900) -> dict:
    """Run ``script`` (which prints ``RESULT <json>``) without the interpreter; returns the JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])
