"""kernels/prefetch.py's host side: the bytes of each program's weight rows a call prefetches into L2
(the whole split while the call's rows fit the budget, else a prefix; 16-byte multiples; none where
a row start is not 16-byte aligned or the device has no bulk prefetch), and the config keys of the
kernels that take it."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.kernels import prefetch
from opmap.kernels.gemm import triton_gemm, w4a16_gluon


@pytest.fixture
def l2_50mb(monkeypatch):
    monkeypatch.setattr(prefetch, "_l2", lambda device: 50 * 2**20)


def test_whole_split_while_the_rows_fit_the_budget(l2_50mb):
    w = torch.empty(128, 2048, dtype=torch.bfloat16)  # a router: 512 KB
    assert prefetch.row_bytes(w, 128, 512, 4) == 512 * 2
    w8 = torch.empty(5120, 2048, dtype=torch.float8_e4m3fn)
    assert prefetch.row_bytes(w8, 5120, 2048, 1) == 2048


def test_a_prefix_of_each_row_beyond_the_budget(l2_50mb):
    w = torch.empty(28672, 4096, dtype=torch.bfloat16)  # 224 MB: half the L2 over its rows
    b = prefetch.row_bytes(w, 28672, 4096, 1)
    assert b % 16 == 0 and 0 < b < 4096 * 2
    assert b * 28672 <= prefetch.BUDGET * 50 * 2**20 < (b + 16) * 28672
    assert prefetch.row_bytes(w, 28672, 1024, 4) == b // 4 // 16 * 16  # four splits share the budget


def test_int4_words_count_half_a_byte_a_code(l2_50mb):
    w = torch.empty(512, 2048 // 8, dtype=torch.int32)
    assert prefetch.row_bytes(w, 512, 2048, 1, 8) == 1024


def test_none_where_rows_are_not_16_byte_aligned(l2_50mb):
    odd_stride = torch.empty(64, 4095, dtype=torch.bfloat16)
    assert prefetch.row_bytes(odd_stride, 64, 4095, 1) == 0
    base = torch.empty(64 * 2048 + 1, dtype=torch.bfloat16)
    shifted = base[1:].view(64, 2048)  # 2-byte offset
    assert prefetch.row_bytes(shifted, 64, 2048, 1) == 0
    assert prefetch.row_bytes(torch.empty(64, 2048, dtype=torch.bfloat16), 64, 1001, 1) == 2000  # rounded down


def test_no_prefetch_off_the_gpu():
    assert prefetch.row_bytes(torch.empty(128, 2048, dtype=torch.bfloat16), 128, 2048, 1) == 0


@pytest.mark.parametrize("config_of", [triton_gemm.config_of, w4a16_gluon.config_of])
def test_config_key(config_of):
    assert config_of({"L2_PREFETCH": 1})["L2_PREFETCH"] == 1
    assert config_of({"L2_PREFETCH": 0})["L2_PREFETCH"] == 0
    with pytest.raises(InputError, match="L2_PREFETCH"):
        config_of({"L2_PREFETCH": 2})
