"""Which dot of the MLA TMA kernel's keys-as-rows layout goes wrong on sm90 (eighth session: its
GPU test gave garbage, the heads-as-rows layout passed). Each mode is one dot on one TMA tile,
against torch in fp32. Usage: python3 scripts/probes/mla_tma_dots.py"""
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter mishandles bf16 dots
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _k(DESC, KVP, X, OUT, MODE: tl.constexpr, BN: tl.constexpr, RH: tl.constexpr, H: tl.constexpr,
       TMA: tl.constexpr):
    rn, rr, rh = tl.arange(0, BN), tl.arange(0, RH), tl.arange(0, H)
    if TMA:
        kv = DESC.load([0, 0, 0]).reshape(BN, RH)
    else:
        kv = tl.load(KVP + rn[:, None] * RH + rr[None, :])
    if MODE == 0:  # scores^T = K q^T: [BN, RH] x [RH, H]
        x = tl.load(X + rr[:, None] * H + rh[None, :])
        o = tl.dot(kv, x)
        tl.store(OUT + rn[:, None] * H + rh[None, :], o)
    elif MODE == 1:  # out^T = V^T p^T: [RH, BN] x [BN, H]
        x = tl.load(X + rn[:, None] * H + rh[None, :])
        o = tl.dot(tl.trans(kv), x)
        tl.store(OUT + rr[:, None] * H + rh[None, :], o)
    elif MODE == 2:  # heads as rows, p V: [H, BN] x [BN, RH]
        x = tl.load(X + rh[:, None] * BN + rn[None, :])
        o = tl.dot(x, kv)
        tl.store(OUT + rh[:, None] * RH + rr[None, :], o)


def main():
    torch.manual_seed(0)
    for BN, RH, H, w in [(64, 256, 16, 4), (64, 128, 16, 4), (32, 256, 64, 8), (64, 64, 16, 4)]:
        kv = torch.randn(1, BN, RH, device=DEV).to(DT)
        desc = TensorDescriptor(kv, [1, BN, RH], [BN * RH, RH, 1], [1, BN, RH])
        for mode in (0, 1, 2):
            shape_x = {0: (RH, H), 1: (BN, H), 2: (H, BN)}[mode]
            x = torch.randn(*shape_x, device=DEV).to(DT)
            k2 = kv[0].float()
            want = {0: lambda: k2 @ x.float(), 1: lambda: k2.T @ x.float(), 2: lambda: x.float() @ k2}[mode]()
            for tma in (True, False):
                out = torch.empty_like(want)
                try:
                    _k[(1,)](desc, kv, x, out, mode, BN, RH, H, tma, num_warps=w)
                    err = (out - want).abs().max().item()
                    print(f"BN={BN} RH={RH} H={H} w={w} mode={mode} tma={tma}: max_err={err:.3g}", flush=True)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"BN={BN} RH={RH} H={H} w={w} mode={mode} tma={tma}: {type(e).__name__}: {e}"[:300])


if __name__ == "__main__":

    main()
