"""Full-width parity on the GPU for the architectures beside Llama and DeepSeek-V2 (those two are in
test_engine_gpu.py): Qwen2 (attention bias), Qwen3 (q/k norm), Mixtral and Qwen3-MoE (MoE).
Random bf16 weights; our logits must stay within 2x HF bf16's own error against HF fp32 on the
same weights, teacher-forced on our tokens (tests/gpu/oracle_util.py, opmap.engine.oracle). The
dense models run all their layers; the MoE ones as many as three copies of the weights (HF bf16,
HF fp32, ours) fit beside each other: Mixtral 4 of 32 layers (~45 GB), Qwen3-30B-A3B 12 of 48
(~62 GB). Where the tokens first differ from HF bf16 greedy is reported, not asserted."""
import dataclasses

import pytest
import torch

from opmap.model.presets import PRESETS

from oracle_util import oracle_parity

pytestmark = pytest.mark.gpu

CASES = [("qwen2.5-7b", None, 32), ("qwen3-8b", None, 32), ("mixtral-8x7b", 4, 16), ("qwen3-30b-a3b", 12, 16),
         ("mistral-7b", 8, 16), ("qwen1.5-moe-a2.7b", 8, 16), ("gemma2-9b", 8, 16), ("gemma3-4b", 8, 16), ("phi3-mini", 8, 16)]


@torch.no_grad()
@pytest.mark.parametrize("name,layers,n_new", CASES, ids=[c[0] for c in CASES])
def test_bf16_within_bf16_noise_of_fp32_oracle(name, layers, n_new, record_property):
    from opmap.core.hw import local_arch

    cfg = PRESETS[name] if layers is None else dataclasses.replace(PRESETS[name], layers=layers)
    page = cfg.default_page_size(local_arch())  # 64 on sm90: 4 x 2048 tokens either way
    oracle_parity(cfg, record_property, (96, 333), n_new, max_num_seqs=4, max_num_batched_tokens=1024,
                  max_model_len=2048, num_pages=4 * 2048 // page)
