"""chat.optimize's int8 rows apart in one kernel call: each row's (scale, zero point) are those torch
chooses for it alone, and the batched product equals one call per row up to float rounding, for
any mix of row ranges, with and without a bias; rows it cannot do that for go one call each."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
from torch.ao.quantization import per_channel_dynamic_qconfig

from chat import optimize


def int8_linear(n_in: int, n_out: int, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(n_in + n_out)
    linear = torch.nn.Linear(n_in, n_out, bias=bias)
    linear.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DynamicLinear.from_float(linear)


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    """Rows of very different ranges (0.03 to 100) and offsets (all positive, all negative, mixed)."""
    g = torch.Generator().manual_seed(seed)
    size = 10 ** torch.empty(n, 1).uniform_(-1.5, 2, generator=g)
    shift = torch.randn(n, 1, generator=g) * torch.rand(n, 1, generator=g) * 3 * size
    return torch.randn(n, width, generator=g) * size + shift


def test_each_rows_qparams_are_those_torch_chooses_for_it_alone():
    for seed in range(200):
        x = rows(8, 96, seed)
        scales, zeros, inverses = optimize.row_qparams(x)
        for i in range(8):
            scale, zero = torch._choose_qparams_per_tensor(x[i], True)  # reduce_range, as the kernel
            assert scales[i, 0].item() == torch.tensor(scale, dtype=torch.float32).item()
            assert zeros[i, 0].item() == zero
            assert inverses[i, 0].item() == (1.0 / torch.tensor(scale, dtype=torch.float32)).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(8, 1, 256), (5, 256), (16, 3, 256)])
def test_rows_apart_in_one_call_equal_one_call_per_row(shape, bias):
    shape = torch.Size(shape)
    layer = int8_linear(256, 192, bias)
    x = rows(shape[0], shape[1:].numel(), shape[0]).view(shape)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(shape[0])])
    with optimize.rows_apart():
        together = optimize.int8_call(layer, x)
    assert together.shape == alone.shape
    assert (together - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
    together_plain = optimize.int8_call(layer, x)  # outside rows_apart: one scale for all rows
    assert (together_plain - alone).abs().max().item() > 1e-3 * alone.abs().max().item()


def test_a_row_of_zeros_takes_one_call_per_row_and_still_replies_as_alone():
    layer = int8_linear(128, 64)
    x = rows(4, 128, 0)
    x[2] = 0.0  # aten gives a zero range the scale 0.1: the rows go one call each
    assert optimize.row_qparams(x) is None
    alone = torch.cat([layer(x[i : i + 1]) for i in range(4)])
    with optimize.rows_apart():
        assert torch.equal(optimize.int8_call(layer, x), alone)


@pytest.mark.parametrize("groups", [(3, 1, 4), (1, 1, 6), (8,)])
def test_groups_of_rows_are_quantized_together_as_one_call_each(groups):
    """A beam-search request's rows share one scale, as in generate() alone; groups beside it their own."""
    layer = int8_linear(256, 192)
    x = rows(8, 256, sum(groups) * 7 + len(groups)).view(8, 1, 256)
    bounds = [0, *torch.tensor(groups).cumsum(0).tolist()]
    alone = torch.cat([layer(x[a:b]) for a, b in zip(bounds, bounds[1:])])
    with optimize.rows_apart(groups):
        together = optimize.int8_call(layer, x)
    assert (together - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
    with optimize.rows_apart():  # row by row is another answer for the groups of several rows
        assert (optimize.int8_call(layer, x) - alone).abs().max().item() > 1e-3 * alone.abs().max().item()
    with optimize.rows_apart((3, 3)), pytest.raises(ValueError, match="do not add up"):
        optimize.int8_call(layer, x)
