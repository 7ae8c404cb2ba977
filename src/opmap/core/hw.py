"""What device this is, and the measured ceilings of its GPU (cached per GPU and driver)."""
from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    arch: str  # "sm90" / "cpu"
    sm_count: Optional[int]
    memory_bytes: Optional[int]
    l2_bytes: Optional[int]
    driver: Optional[str]
    torch: str
    triton: Optional[str]
    cuda: Optional[str]
    cudnn: Optional[str]
    python: str
    interpreter: bool  # Triton kernels run through TRITON_INTERPRET

    def lines(self) -> list[tuple[str, str]]:
        gib = lambda b: f"{b / 2**30:.1f} GiB" if b else "n/a"  # noqa: E731
        rows = [("device", self.name), ("arch", self.arch)]
        if self.kind == "cuda":
            rows += [("SMs", str(self.sm_count)), ("memory", gib(self.memory_bytes)),
                     ("L2", f"{(self.l2_bytes or 0) / 2**20:.0f} MiB"), ("driver", str(self.driver))]
        rows += [("torch", self.torch), ("triton", str(self.triton)), ("CUDA", str(self.cuda)),
                 ("cuDNN", str(self.cudnn)), ("python", self.python)]
        if self.kind == "cpu":
            rows.append(("note", "no GPU: Triton kernels run through the interpreter "
                                 f"(TRITON_INTERPRET={'1' if self.interpreter else 'unset; set it to 1'}); "
                                 "GPU timings need a GPU"))
        return rows


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def detect() -> DeviceInfo:
    try:
        # heavy: triton, for its version only (importing hw, as the CLI does at start, loads none of it)
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    cudnn = None
    if torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()
        cudnn = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v and v >= 10000 else str(v)
    common = dict(torch=torch.__version__, triton=tv, cuda=torch.version.cuda, cudnn=cudnn,
                  python=platform.python_version(), interpreter=os.environ.get("TRITON_INTERPRET") == "1")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return DeviceInfo("cuda", p.name, f"sm{p.major}{p.minor}", p.multi_processor_count,
                          p.total_memory, getattr(p, "L2_cache_size", None), _driver_version(), **common)
    return DeviceInfo("cpu", platform.processor() or platform.machine(), "cpu", None, None, None, None,
                      **common)


def local_arch() -> str:
    return detect().arch


# ---- ceilings ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ceilings:
    read_tbps: float  # HBM read bandwidth through a large reduction
    copy_tbps: float  # device-to-device copy, bytes read + written
    bf16_tflops: float  # bf16 GEMM at 8192^3, random data
    gpu: str
    driver: str
    measured_at: str

    def as_dict(self) -> dict:
        return asdict(self)


def cache_dir() -> Path:
    base = os.environ.get("OPMAP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opmap")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _cache_file(info: DeviceInfo) -> Path:
    key = f"{info.name}-{info.driver}".replace(" ", "_").replace("/", "_")
    return cache_dir() / f"ceilings-{key}.json"


def median_ms(fn, reps: int = 20, before=None) -> float:
    """Median CUDA-event time of ``reps`` single calls of ``fn`` after three; ``before`` runs
    (untimed) ahead of each timed call."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for s, e in zip(start, end):
        if before is not None:
            before()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ts[len(ts) // 2]


def measure_ceilings() -> Ceilings:
    """Measure the three ceilings on GPU 0 (a few seconds)."""
    info = detect()
    if info.kind != "cuda":
        raise RuntimeError("ceilings are measured on a GPU; this machine has none")
    dev = torch.device("cuda")
    # Read: sum over 4 GiB of bf16, far past the L2.
    x = torch.randn(2 * 2**30, device=dev, dtype=torch.bfloat16)
    t_read = median_ms(lambda: torch.sum(x, dtype=torch.float32))
    read = x.numel() * x.element_size() / (t_read * 1e-3) / 1e12
    # Copy: 2 GiB -> 2 GiB, counting read + write.
    src = x[: 2**30]
    dst = torch.empty_like(src)
    t_copy = median_ms(lambda: dst.copy_(src))
    copy = 2 * src.numel() * src.element_size() / (t_copy * 1e-3) / 1e12
    del x, dst
    # bf16 GEMM 8192^3 on random data.
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    t_mm = median_ms(lambda: torch.mm(a, b, out=c), reps=10)
    tflops = 2 * n**3 / (t_mm * 1e-3) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return Ceilings(round(read, 3), round(copy, 3), round(tflops, 1), info.name, str(info.driver),
                    datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def ceilings(measure: bool = True, refresh: bool = False) -> Optional[Ceilings]:
    """The cached ceilings of this GPU; measured (and cached) when missing and ``measure``."""
    info = detect()
    if info.kind != "cuda":
        return None
    f = _cache_file(info)
    if f.exists() and not refresh:
        try:
            return Ceilings(**json.loads(f.read_text()))
        except (ValueError, TypeError):
            pass  # a corrupt or old cache file is measured again
    if not measure:
        return None
    c = measure_ceilings()
    f.write_text(json.dumps(c.as_dict(), indent=1))
    return c
