"""The sampler kernel tests again, with the GPU's code path forced on the interpreter: pass A
split over chunks (of 256 here), the histogram bracket and the spread gather (passes B and C).
On the CPU the sampler otherwise runs one program per row with none of them, so the edge cases
(one finite logit, ties, invalid rows, top_p = 1, k = V, ...) would reach those kernels only on a GPU.
Collected again here: the tests that take the sampler's default chunking (the others pass ``chunk=``
themselves, so they would run the same code twice)."""
import pytest

from test_sampling_kernel import (  # noqa: F401
    test_config_override_same_tokens_and_checked, test_dtypes_and_strided_rows, test_empty_batch,
    test_equal_logits_keep_lowest_ids,
    test_invalid_rows_are_flagged_and_others_unaffected, test_k1_and_temperature0_are_greedy_with_ties,
    test_min_p_one_keeps_only_the_maximum, test_no_op_filters_change_nothing, test_seeded_rows_do_not_depend_on_the_batch,
    test_single_finite_logit_always_chosen, test_support_and_tokens_match_reference)

# As in test_sampling_kernel: rows of NaN / inf logits on purpose, and the interpreter's NumPy
# warning on the masked lanes (-inf - -inf) and on casting them.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture(autouse=True)
def gpu_chunking(monkeypatch):
    from opmap.kernels.sampling import sampler

    block, cand, warps, _ = sampler._config(__import__("torch").device("cpu"))
    monkeypatch.setattr(sampler, "_config", lambda dev: (block, cand, warps, 256))
