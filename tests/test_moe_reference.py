"""MoE reference against independent formulations (HF transformers' MoE blocks and routers with
the same weights), the torch peers against the reference, bad input, and the declarations."""
import pytest
import torch
import torch.nn.functional as F

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.ops.moe import reference
from opmap.peers.moe import torch_grouped
from opmap.peers.moe import torch_loop
from opmap.ops.moe.routing import route
from opmap.core.select import BackendError, select
from opmap.core.specs import MoESpec
from opmap.core.tolerance import assert_close

transformers = pytest.importorskip("transformers")


def _weights(E, H, I, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return w13, w2


def _hf_block(block_cls, config):
    block = block_cls(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _experts_of(block):
    # transformers 5.x stores experts as 3-D tensors: gate_up_proj [E, 2I, H] (gate rows first),
    # down_proj [E, H, I]: exactly our w13 / w2 layout.
    return block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()


@pytest.mark.parametrize("T", [1, 5, 33])
def test_reference_matches_hf_mixtral(T):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)
    block = _hf_block(MixtralSparseMoeBlock, cfg)
    x = torch.randn(1, T, 48)
    with torch.no_grad():
        want = block(x)[0]
    logits = F.linear(x[0], block.gate.weight)
    w13, w2 = _experts_of(block)
    got = reference.moe(x[0], logits, w13, w2, 2)
    assert_close(got, want, torch.float32, scale=2, what="reference vs HF Mixtral")


def test_reference_matches_hf_qwen3_moe_without_renormalisation():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=4,
                             norm_topk_prob=norm)
        block = _hf_block(Qwen3MoeSparseMoeBlock, cfg)
        x = torch.randn(1, 9, 32)
        with torch.no_grad():
            want = block(x)[0]
        logits = F.linear(x[0], block.gate.weight)
        w13, w2 = _experts_of(block)
        got = reference.moe(x[0], logits, w13, w2, 4, renormalize=norm)
        assert_close(got, want, torch.float32, scale=10, what=f"reference vs HF Qwen3-MoE norm={norm}")


def _same_routing(w, ids, hw, hids):
    # HF uses topk(sorted=False): compare the selections as sets, ordered by expert id.
    o1, o2 = ids.long().sort(-1), hids.long().sort(-1)
    assert torch.equal(o1.values, o2.values)
    assert_close(w.gather(1, o1.indices), hw.float().gather(1, o2.indices), torch.float32, what="weights")


def test_route_matches_hf_deepseek_v2_group_limited_greedy():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = DeepseekV2Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=3,
                           n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.5,
                           n_shared_experts=1)
    block = _hf_block(DeepseekV2Moe, cfg)
    x = torch.randn(1, 11, 32)
    logits, hw, hids = block.gate(x)
    w, ids = route(logits, 3, renormalize=False, n_group=4, topk_group=2, routed_scaling=2.5)
    _same_routing(w, ids, hw.detach(), hids)
    # The whole block: routed experts from our reference plus HF's own shared-expert MLP.
    with torch.no_grad():
        want = block(x)[0]
        shared = block.shared_experts(x)[0]
    w13, w2 = _experts_of(block)
    got = reference.moe(x[0], logits.detach(), w13, w2, 3, renormalize=False, n_group=4, topk_group=2,
                        routed_scaling=2.5) + shared
    assert_close(got, want, torch.float32, scale=2, what="reference vs HF DeepSeek-V2 MoE")


def test_route_matches_hf_deepseek_v3_sigmoid_bias_grouped():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=32, num_experts_per_tok=4,
                           n_group=8, topk_group=3, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(13, 32)
    logits, hw, hids = router(x)
    w, ids = route(logits.detach(), 4, router="sigmoid_grouped", n_group=8, topk_group=3, routed_scaling=2.5,
                   score_bias=router.e_score_correction_bias)
    _same_routing(w, ids, hw.detach(), hids)


def test_route_softmax_renormalised_by_hand():
    logits = torch.randn(7, 8)
    w, ids = route(logits, 3)
    p = logits.softmax(-1)
    top = p.topk(3, -1)
    assert torch.equal(ids.long(), top.indices) and ids.dtype == torch.int32 and w.dtype == torch.float32
    assert_close(w, top.values / top.values.sum(-1, keepdim=True), torch.float32)


@pytest.mark.parametrize("name", ["torch-loop", "torch-grouped-mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_peers_match_reference(name, dtype):
    E, H, I, k = 8, 40, 24, 3
    w13, w2 = _weights(E, H, I, dtype)
    for T in (1, 17):
        x = torch.randn(T, H).to(dtype)
        logits = torch.randn(T, E)
        logits[:, 5] = -1e4  # expert 5 receives no token
        got = registry.get("moe", name)("moe", x, logits, w13, w2, k)
        want = reference.moe(x.float(), logits, w13.float(), w2.float(), k)
        assert got.dtype == dtype
        assert_close(got, want, dtype, scale=4, what=f"{name} T={T}")


def test_peers_all_tokens_on_one_expert_and_empty_batch():
    E, H, I = 4, 16, 8
    w13, w2 = _weights(E, H, I)
    x = torch.randn(9, H)
    logits = torch.full((9, E), -5.0)
    logits[:, 2] = 5.0
    want = reference.moe(x, logits, w13, w2, 1)
    for fn in (torch_loop.moe, torch_grouped.moe):
        assert_close(fn(x, logits, w13, w2, 1), want, torch.float32, scale=4)
        assert fn(x[:0], logits[:0], w13, w2, 2).shape == (0, H)


BAD = [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(x=torch.randn(3, 17)), "w13"),  # hidden size of x != hidden size of the experts
    (dict(w2=torch.randn(4, 16, 9)), "w2"),
    (dict(w13=torch.randn(4, 15, 16)), "w13"),
    (dict(x=torch.randn(3, 16, dtype=torch.float16)), "w13"),
    (dict(x=torch.randint(0, 3, (3, 16))), "x"),
    (dict(router_logits=torch.randn(4, 4)), "router_logits"),
    (dict(router_logits=torch.randn(3, 5)), "router_logits"),
    (dict(router="relu"), "router"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=4, topk_group=1, top_k=2), "top_k"),
    (dict(score_bias=torch.randn(5)), "score_bias"),
]


@pytest.mark.parametrize("name", ["reference", "torch-loop", "torch-grouped-mm", "triton"])
@pytest.mark.parametrize("bad,arg", BAD, ids=[a for _, a in BAD])
def test_bad_input_names_the_argument(name, bad, arg):
    args = dict(x=torch.randn(3, 16), router_logits=torch.randn(3, 4), w13=torch.randn(4, 16, 16),
                w2=torch.randn(4, 16, 8), top_k=2)
    args.update(bad)
    pos = [args.pop(a) for a in ("x", "router_logits", "w13", "w2", "top_k")]
    with pytest.raises(InputError) as e:
        registry.get("moe", name)("moe", *pos, **args)
    assert e.value.arg == arg


def test_declarations_and_selection():
    names = {b.name for b in registry.backends("moe")}
    assert {"reference", "torch-loop", "torch-grouped-mm", "triton", "dequant-triton"} <= names
    for b in registry.backends("moe"):
        # warm_up: where a backend tunes kernels per token count (the engine runs it at start-up)
        ours = b.name in ("triton", "dequant-triton")
        assert set(b.impl) == ({"moe", "route", "warm_up"} if ours else {"moe", "route"})
    cpu = select("moe", MoESpec(arch="cpu", dtype="fp32", weight_dtype="fp32"), runtime=False)
    assert cpu.name == "reference"
    gm = registry.get("moe", "torch-grouped-mm")
    assert any("bf16" in r for r in gm.validate(MoESpec(arch="sm90", dtype="fp16")))
    assert gm.validate(MoESpec(arch="sm90", dtype="bf16")) == []
    assert registry.get("moe", "triton").validate(MoESpec(top_k=9, num_experts=8))
    with pytest.raises(BackendError, match="fp8"):
        select("moe", MoESpec(arch="sm90", weight_dtype="fp8"), backend="triton", runtime=False)


def test_grouped_mm_unaligned_rows_are_an_input_error():
    w13, w2 = _weights(4, 16, 20, torch.float16)  # 20 fp16 = 40-byte rows: not 16-byte aligned
    x, logits = torch.randn(3, 16).half(), torch.randn(3, 4)
    with pytest.raises(InputError) as e:
        torch_grouped.moe(x, logits, w13, w2, 2)
    assert e.value.arg == "w2"
    assert registry.get("moe", "torch-grouped-mm").validate(
        MoESpec(arch="cpu", dtype="fp16", weight_dtype="fp16", hidden=16, intermediate=20))
