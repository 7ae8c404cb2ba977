"""Shared helpers of the engine tests (not a test module)."""
import pytest
import torch


@pytest.fixture
def single_thread():
    # Two shared cores: intra-op threads of tiny CPU ops spin against each other (index_add_
    # goes from microseconds to tens of milliseconds), so these tests run single-threaded.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def word_tokenizer(vocab: int):
    """A WordLevel tokenizer over words w0..w{vocab-1}, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def random_prompts(vocab: int, lengths, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, prompt: list, n: int) -> list:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def first_near_tie(hf, prompt: list, ref: list, tol: float = 1e-4):
    """First generated position where HF's own top-2 logits are within ``tol`` (None if none)."""
    ids = torch.tensor([prompt + ref])
    logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    top = logits.topk(2, dim=-1).values
    gap = (top[:, 0] - top[:, 1]).abs()
    close = (gap < tol).nonzero()
    return int(close[0]) if len(close) else None
