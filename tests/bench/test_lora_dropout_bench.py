"""bench/lora_dropout.py: it refuses a machine without a GPU in words, and (GPU) times every case,
tiling and extra module on small shapes and writes them to results.json."""

from __future__ import annotations

import json

import pytest
import torch

from bench import lora_dropout as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_it_refuses_a_machine_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--out", str(tmp_path)])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_case_and_tiling_is_timed(tmp_path, monkeypatch):
    from finetune import lora_dropout

    monkeypatch.setattr(bench, "SHAPES", ((4096, 256),))
    for name in ("BLOCK_M", "BLOCK_K", "NUM_WARPS"):  # the bench sets them: put them back afterwards
        monkeypatch.setattr(lora_dropout, name, getattr(lora_dropout, name))
    argv = ["--out", str(tmp_path), "--blocks", "64:64:4,32:64:4", "--also", "finetune.lora_dropout"]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    cases = [(r["case"], r.get("block_m")) for r in results]
    assert cases == [
        ("torch-dropout", None),
        ("no-dropout", None),
        ("kernels", 64),
        ("finetune.lora_dropout", 64),
        ("kernels", 32),
        ("finetune.lora_dropout", 32),
    ]
    assert all(r["ms"] > 0 and r["forward_ms"] > 0 and r["gb_per_s"] > 0 for r in results)
