"""The fp32-oracle parity check shared by the GPU parity tests (see
tests/gpu/test_engine_gpu.py::test_llama3_8b_bf16_within_bf16_noise_of_fp32_oracle)."""
import gc

import torch


def random_prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def oracle_parity(cfg, record_property, lengths, n_new, **engine_kw):
    """Engine on random bf16 weights against HF fp32 (oracle) and HF bf16 (noise) on the same
    weights; see tests/gpu/test_engine_gpu.py."""
    from transformers import AutoModelForCausalLM

    from opmap.engine import oracle
    from opmap.model.hf import to_hf_config
    from opmap.engine.llm import LLM
    from opmap.engine.weights import StateDictSource

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle must not run in TF32
    llm = hf16 = hf32 = None
    try:
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf16 = AutoModelForCausalLM.from_config(to_hf_config(cfg), dtype=torch.bfloat16).eval()
            hf32 = AutoModelForCausalLM.from_config(to_hf_config(cfg), dtype=torch.float32).eval()
        hf32.load_state_dict(hf16.state_dict())  # exactly the bf16 weights, in fp32
        llm = LLM(cfg, source=StateDictSource(hf16.state_dict()), **engine_kw)
        assert llm.runner.unused == []
        report, figures = [], []
        for p in random_prompts(cfg.vocab, lengths, seed=3):
            ref = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=n_new, min_new_tokens=n_new,
                                do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            figures.append(oracle.compare(llm, hf16, hf32, p, n_new, ref))
            report.append(f"prompt {len(p)}: {oracle.verdict(figures[-1])[1]}")
        # One verdict over all prompts' positions (oracle.pool says why).
        ok, line = oracle.verdict(oracle.pool(figures))
        report.append(f"all prompts: {line}")
        record_property("oracle_parity", "; ".join(report))
        print("\n".join(report))
        assert ok, report
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        if llm is not None:
            llm.close()
        del hf16, hf32
        free_gpu()
