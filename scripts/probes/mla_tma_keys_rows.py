"""Where the MLA TMA kernel's keys-as-rows layout goes wrong on sm90 (eighth session: garbage in
its GPU test while each of its dots alone is right, scripts/probes/mla_tma_dots.py). Splits the
cases: whole tiles only or a partial last tile, NaN past the lengths or not, one split or the
plan's, pipelined (2 stages) or not. Usage: python3 scripts/probes/mla_tma_keys_rows.py"""
import torch

from opmap.ops.mla import decode as dec
from opmap.ops.mla import reference as ref
from opmap.ops.mla.testing import make_cache

R, DR, H, PAGE = 512, 64, 16, 64
for lens in ([65, 1000, 4099], [64, 128, 4096]):
    for poison in (False, True):
        pc = make_cache(lens, R, DR, PAGE, torch.bfloat16, device="cuda", gen=torch.Generator().manual_seed(1), std=0.5)
        if poison:
            for b, n in enumerate(lens):
                if n % PAGE:
                    pc.cache[int(pc.block_tables[b, n // PAGE]), n % PAGE:] = float("nan")
        g = torch.Generator(device="cuda").manual_seed(2)
        qn = torch.randn(len(lens), H, R, generator=g, device="cuda").bfloat16()
        qp = torch.randn(len(lens), H, DR, generator=g, device="cuda").bfloat16()
        want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=576 ** -0.5)
        # (16, 64, 4, 1, "tma") ran into an illegal address on the H200 (eighth session), and the
        # error sticks to the process: the one-stage build is left out
        for cfg in ((16, 64, 4, 2, "tma"), (64, 32, 8, 2, "tma"), (16, 32, 4, 2, "tma")):
            for splits in (1, None):
                ws = dec.make_workspace(len(lens), H, R, "cuda", config=cfg, num_splits=splits)
                try:
                    got = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=576 ** -0.5,
                                         workspace=ws, config=cfg)
                    torch.cuda.synchronize()
                    bad = (~torch.isfinite(got.float())).sum().item()
                    err = (got.float() - want.float()).nan_to_num(1e30).abs().amax(dim=(1, 2)).tolist()
                    print(f"lens={lens} poison={poison} cfg={cfg} splits={ws.num_splits}: nonfinite={bad} "
                          f"max_err per seq={[f'{e:.3g}' for e in err]}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"lens={lens} poison={poison} cfg={cfg} splits={splits}: {type(e).__name__}: {e}"[:300])
