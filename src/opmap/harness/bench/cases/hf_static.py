"""HF transformers at its best offline: the gpt-fast recipe on an HF model. A static KV cache, the
prefill forward eager, and the one-token decode forward compiled with static shapes
(``torch.compile(mode="reduce-overhead", fullgraph=True)``: Inductor kernels replayed as CUDA
graphs), driven token by token by a greedy loop of our own instead of ``generate`` (whose
auto-compile sizes the cache per call, so a timed call would compile again).
The e2e benchmark's "hf-transformers-static-compile" rows (``e2e._hf_static``)."""
from __future__ import annotations

import time

import torch


def static_cache(hf, batch: int, max_len: int):
    """A StaticCache of ``max_len`` tokens, its tensors made now (not inside the compiled graph);
    for MLA models (keys of qk_nope + qk_rope dims, values of v_head_dim) at the eager prefill's
    first update instead, which sizes keys and values apart."""
    # heavy: transformers
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=max_len)
    c = hf.config
    if getattr(c, "v_head_dim", None) and getattr(c, "qk_nope_head_dim", None):
        return cache
    heads = c.num_key_value_heads or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache.early_initialization(batch, heads, d, hf.dtype, hf.device)
    return cache


class StaticGreedy:
    """Greedy decoding of ``batch`` prompts of equal length, at most ``max_len`` tokens in all."""

    def __init__(self, hf, batch: int, max_len: int, compile: bool = True):
        self.hf, self.cache = hf, static_cache(hf, batch, max_len)

        def step(tok, pos):
            return hf(input_ids=tok, past_key_values=self.cache, cache_position=pos, use_cache=True).logits[:, -1]

        self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile else step

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new: int) -> tuple:
        """(tokens [B, new], prefill seconds, decode seconds of the other new - 1 tokens)."""
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        self.cache.reset()
        B, P = ids.shape
        pos = torch.arange(P + new, device=ids.device)
        sync()
        t0 = time.perf_counter()
        out = self.hf(input_ids=ids, past_key_values=self.cache, cache_position=pos[:P], use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        toks = [tok]
        for i in range(new - 1):
            # the argmax reads the logits before the next replay overwrites the graph's output
            tok = self.step(tok, pos[P + i:P + i + 1]).argmax(-1, keepdim=True)
            toks.append(tok)
        sync()
        return torch.cat(toks, 1), t1 - t0, time.perf_counter() - t1
