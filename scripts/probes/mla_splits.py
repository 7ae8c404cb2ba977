"""The 16-head MLA decode at B=1 / 32k against its split count (the eleventh session's
decomposition, scripts/probes/mla_decompose.py: the merge takes 6.7 of the op's 30 us there at 128
splits). Times the whole op (kernel + merge) at the default config for 32 to 256 splits.
Usage (GPU): python3 scripts/probes/mla_splits.py"""
import torch

from opmap import hw
from opmap.bench import timing
from opmap.ops.mla import decode as dec
from opmap.ops.mla.testing import make_cache

R, DR, H, PAGE = 512, 64, 16, 64
ceil = hw.ceilings(measure=True)
for B, ctx in ((1, 32768), (1, 8192), (16, 4096)):
    pc = make_cache([ctx] * B, R, DR, PAGE, torch.bfloat16, device="cuda", gen=torch.Generator().manual_seed(0))
    qn = torch.randn(B, H, R, device="cuda").bfloat16()
    qp = torch.randn(B, H, DR, device="cuda").bfloat16()
    nbytes = B * ctx * (R + DR) * 2
    want = None
    for splits in (None, 32, 64, 128, 256):
        ws = dec.make_workspace(B, H, R, "cuda", num_splits=splits)
        f = lambda: dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=576 ** -0.5, workspace=ws)  # noqa: E731
        got = f().float()
        want = got if want is None else want
        t = timing.time_calls([f], graph=True)
        print(f"B={B} ctx={ctx} splits={ws.num_splits}{' (plan)' if splits is None else ''}: {t.median_us:.2f} us, "
              f"{nbytes / (t.median_us * 1e-6) / 1e12 / ceil.read_tbps:.3f} of the read ceiling, "
              f"max diff to the plan's output {(got - want).abs().max().item():.1e}", flush=True)
    del pc
