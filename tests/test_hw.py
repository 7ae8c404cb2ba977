"""Device facts and the ceilings cache (the measurement itself runs on the GPU test machine)."""
import dataclasses
import json

import pytest
import torch

from opmap.core import hw


def test_detect_this_machine():
    info = hw.detect()
    assert info.torch == torch.__version__
    if torch.cuda.is_available():
        assert info.kind == "cuda" and info.arch.startswith("sm") and info.sm_count > 0
    else:
        assert info.kind == "cpu" and info.arch == "cpu" and info.sm_count is None
        rows = dict(info.lines())
        assert "no GPU" in rows["note"] and "interpreter" in rows["note"]
        assert hw.ceilings() is None  # nothing is measured (or invented) without a GPU
    assert hw.local_arch() == info.arch


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("OPMAP_CACHE_DIR", str(tmp_path / "cache"))
    info = dataclasses.replace(hw.detect(), kind="cuda", name="NVIDIA Fake 100", arch="sm90", driver="999.1")
    monkeypatch.setattr(hw, "detect", lambda: info)
    return info


def test_ceilings_cache_per_gpu_and_driver(fake_gpu, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return hw.Ceilings(4.1, 4.0, 700.0, fake_gpu.name, fake_gpu.driver, "2026-01-01T00:00:00+00:00")

    monkeypatch.setattr(hw, "measure_ceilings", measure)
    assert hw.ceilings(measure=False) is None
    c = hw.ceilings()
    assert c.read_tbps == 4.1 and len(calls) == 1
    f = hw._cache_file(fake_gpu)
    assert f.name == "ceilings-NVIDIA_Fake_100-999.1.json" and json.loads(f.read_text())["bf16_tflops"] == 700.0
    assert hw.ceilings() == c and len(calls) == 1  # from the cache
    assert hw.ceilings(refresh=True) == c and len(calls) == 2
    f.write_text("{not json")
    assert hw.ceilings() == c and len(calls) == 3  # a corrupt cache is measured again


def test_env_prints_ceilings_on_gpu(fake_gpu, monkeypatch, capsys):
    from opmap.cli import main as cli

    c = hw.Ceilings(4.2, 4.1, 760.0, fake_gpu.name, fake_gpu.driver, "2026-01-01T00:00:00+00:00")
    hw._cache_file(fake_gpu).write_text(json.dumps(c.as_dict()))
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "4.20 TB/s" in out and "760 TFLOP/s" in out and "NVIDIA Fake 100" in out
