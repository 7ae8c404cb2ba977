"""Record one profiler trace per rank of a tensor-parallel decoder block and an expert-parallel
MoE on 2 ranks, at prefill and decode sizes: NCCL on 2 GPUs (NCCL_NVLS_ENABLE=0) at Llama-3-8B /
Mixtral-8x7B shapes, or gloo on the CPU at reduced widths (the CPU fixtures of `opmap profile
--trace`). Each step runs inside a record_function("execute_model") range and each layer in a range
of its module's name, as vLLM's do.

    python3 scripts/record_tp_traces.py OUTDIR [--backend nccl|gloo] [--world 2]
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _shapes(gpu: bool) -> dict:
    if gpu:  # Llama-3-8B attention and MLP; Mixtral-8x7B experts
        return dict(H=4096, heads=32, kv=8, D=128, I=14336, E=8, k=2, EI=14336, T=(1024, 8), L=2048)
    return dict(H=256, heads=8, kv=4, D=32, I=512, E=4, k=2, EI=384, T=(64, 4), L=128)


def _block(x, w, s, rank, world, kv_len):
    """A decoder block, tensor parallel: column-parallel QKV and gate/up, row-parallel O and down,
    an all-reduce after each row-parallel GEMM."""
    T = x.shape[0]
    hq, hk, D = s["heads"] // world, s["kv"] // world, s["D"]
    h = F.rms_norm(x, (x.shape[1],))
    qkv = h @ w["qkv"].T
    q, k, v = qkv.split([hq * D, hk * D, hk * D], dim=1)
    q = q.view(1, T, hq, D).transpose(1, 2)
    kc = torch.cat([w["k_cache"], k.view(1, T, hk, D).transpose(1, 2)], dim=2)[:, :, -kv_len:]
    vc = torch.cat([w["v_cache"], v.view(1, T, hk, D).transpose(1, 2)], dim=2)[:, :, -kv_len:]
    a = F.scaled_dot_product_attention(q, kc, vc, is_causal=T > 1, enable_gqa=True)
    o = a.transpose(1, 2).reshape(T, hq * D) @ w["o"].T
    dist.all_reduce(o)
    x = x + o
    h = F.rms_norm(x, (x.shape[1],))
    g, u = (h @ w["gate_up"].T).chunk(2, dim=1)
    m = (F.silu(g) * u) @ w["down"].T
    dist.all_reduce(m)
    return x + m


def _moe(x, w, s, rank, world):
    """An expert-parallel MoE: route, all-to-all the tokens to their experts' rank, the local
    experts' GEMMs, all-to-all back, combine."""
    E, k = s["E"], s["k"]
    per = E // world
    top_w, top_i = torch.topk(torch.softmax(x @ w["router"].T, -1), k, dim=-1)
    flat = top_i.flatten()
    order = torch.argsort(torch.div(flat, per, rounding_mode="floor"), stable=True)
    dest = torch.div(flat[order], per, rounding_mode="floor")
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    tokens = x.repeat_interleave(k, dim=0)[order]
    got = x.new_empty(int(recv.sum()), x.shape[1])
    dist.all_to_all_single(got, tokens, recv.tolist(), send.tolist())
    ids = flat[order].new_empty(int(recv.sum()))
    dist.all_to_all_single(ids, flat[order].contiguous(), recv.tolist(), send.tolist())
    out = torch.zeros_like(got)
    for e in range(per):
        sel = (ids - rank * per) == e
        if sel.any():
            g, u = (got[sel] @ w["w13"][e].T).chunk(2, dim=1)
            out[sel] = (F.silu(g) * u) @ w["w2"][e].T
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, out, send.tolist(), recv.tolist())
    y = torch.zeros_like(x)
    y.index_add_(0, torch.div(order, k, rounding_mode="floor"), back * top_w.flatten()[order, None])
    return x + y


def _worker(rank: int, world: int, backend: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", NCCL_NVLS_ENABLE="0")
    gpu = backend == "nccl"
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    s = _shapes(gpu)
    dt = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator(device=dev).manual_seed(rank)
    r = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02  # noqa: E731
    hq, hk, D, H = s["heads"] // world, s["kv"] // world, s["D"], s["H"]
    w = {"qkv": r((hq + 2 * hk) * D, H), "o": r(H, hq * D), "gate_up": r(2 * s["I"] // world, H),
         "down": r(H, s["I"] // world), "router": r(s["E"], H), "w13": r(s["E"] // world, 2 * s["EI"], H),
         "w2": r(s["E"] // world, H, s["EI"]),
         "k_cache": r(1, hk, s["L"], D), "v_cache": r(1, hk, s["L"], D)}
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])

    def steps():
        for T in (s["T"][0], s["T"][1], s["T"][1], s["T"][1]):  # a prefill step, then decode steps
            with record_function("execute_model"):
                x = r(T, H)
                with record_function("model.layers.0.self_attn+mlp"):  # the layer ranges an engine emits
                    x = _block(x, w, s, rank, world, s["L"])
                with record_function("model.layers.1.FusedMoE"):
                    x = _moe(x, w, s, rank, world)
                x.sum().item()  # the step's readback

    with torch.no_grad():
        steps()  # warm-up: NCCL communicators, cuBLAS handles
        if gpu:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            steps()
            if gpu:
                torch.cuda.synchronize()
    path = os.path.join(out, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb", compresslevel=9) as z:
        shutil.copyfileobj(f, z)
    os.remove(path)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.device_count() >= 2 else "gloo")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.multiprocessing.spawn(_worker, args=(a.world, a.backend, a.out), nprocs=a.world, join=True)
    print(f"wrote {a.world} traces ({a.backend}) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
