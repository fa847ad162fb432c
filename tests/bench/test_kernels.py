"""bench/kernels.py on the CPU: the smoke run measures every part, the fp8 linear layer's output
and gradients are those of the bf16 one within fp8's rounding, and the variable-length kernel's
sequence starts cover every token of the flattened rows."""

import json

import pytest
import torch
import torch.nn.functional as F

from bench.kernels import Fp8Linear, cumulative, fp8_cast, main, step_linears


def test_kernels_smoke(tmp_path, capsys):
    assert main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernels.json").read_text())
    for kind in ("encoder", "decoder", "cross"):
        assert isinstance(result["attention"][f"{kind} math mask"], float)
    linear = result["linear"]
    assert len(linear["per_shape_ms"]) == 6 and linear["step_total_ms"]["bf16"] > 0
    assert all(r["fp8 relative error"] < 0.1 for r in linear["per_shape_ms"].values())
    assert "per step" in capsys.readouterr().out


def test_fp8_linear_follows_the_bf16_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g).bfloat16()
    w = (torch.randn(32, 48, generator=g) / 7).bfloat16()
    b = torch.randn(32, generator=g).bfloat16()
    grad = torch.randn(64, 32, generator=g).bfloat16()
    results = []
    for linear in (lambda *a: F.linear(*a), lambda *a: Fp8Linear.apply(*a, fp8_cast)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = linear(*leaves)
        y.backward(grad)
        results.append([y, *(t.grad for t in leaves)])
    *exact, exact_bias_grad = results[0]
    *fp8, fp8_bias_grad = results[1]
    for a, b in zip(exact, fp8):  # output, input gradient, weight gradient
        error = ((b.float() - a.float()).norm() / a.float().norm()).item()
        assert 0 < error < 0.1  # fp8's rounding, and nothing worse
    assert torch.equal(fp8_bias_grad, exact_bias_grad)  # the bias gradient is the plain sum


def test_variable_length_starts_cover_the_flattened_rows():
    starts, longest = cumulative([[3, 1], [4], [0, 2]], "cpu")
    assert starts.tolist() == [0, 3, 4, 8, 8, 10] and starts.dtype == torch.int32 and longest == 4


def test_a_step_has_the_model_s_linear_layers():
    shapes = step_linears(rows=2, source=8, target=4, d=16, ffn=64, encoder=2, decoder=12)
    # 2 encoder layers x 6 and 12 decoder layers x 10 linear layers
    assert sum(shapes.values()) == 2 * 6 + 12 * 10


@pytest.mark.parametrize(
    "args", [["--parts", "nope"], ["--parts", "attention,nope"], ["--batch", "0"], ["--repeats", "0"]]
)
def test_bad_arguments_are_refused_with_a_message(tmp_path, args, capsys):
    with pytest.raises(SystemExit):
        main(["--smoke", *args, "--out", str(tmp_path)])
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "kernels.json").exists()
