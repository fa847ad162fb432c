"""chat.optimize's int8 rows apart in one kernel call: each row's (scale, zero point) are those torch
chooses for it alone, and the batched product equals one call per row up to float rounding, for
any mix of row ranges, with and without a bias; rows it cannot do that for go one call each."""

from __future__ import annotations

import contextlib
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


def test_each_rows_integers_are_those_the_kernel_multiplies_for_the_row_alone():
    """fbgemm quantizes a row as round(fma(x, 1 / scale, zero)): one rounding of the exact product
    and sum, then half to even, clamped to 0..255. Inside ``rows_apart`` each row's integers are
    exactly those. (Two roundings, a float32 product then the sum, differ on values within an ulp of
    a half.) An identity weight shows the integers. Left out: rows whose zero point itself is on a
    tie (the two formulas aten weighs give different integers; the kernel's pick differs from
    aten's ChooseQuantizationParams there), about 1 row in 400 of this rounded data and never seen on
    real activations."""
    n = 64
    linear = torch.nn.Linear(n, n, bias=False)
    linear.weight.data = torch.eye(n)
    linear.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = DynamicLinear.from_float(linear)
    unit = layer.weight().q_per_channel_scales().float() * 127  # each output is scale * unit * (q - zero)
    two_roundings_differ = 0
    for seed in range(100):
        x = (torch.randn(32, n, generator=torch.Generator().manual_seed(seed)) * 3).round(decimals=2)  # many ties
        scale, zero, inverse = optimize.row_qparams(x)
        low, high = x.amin(1, keepdim=True).clamp(max=0).double(), x.amax(1, keepdim=True).clamp(min=0).double()
        clear = ((-low / scale.double()).round() == (127 - high / scale.double()).round())[:, 0]
        alone = torch.cat([layer(x[i : i + 1]) for i in range(32)])
        with optimize.rows_apart():
            together = optimize.int8_call(layer, x)
        integers_alone = (alone / (scale * unit)).round() + zero
        assert torch.equal(integers_alone[clear], ((together / (scale * unit)).round() + zero)[clear])
        two_roundings = (x * inverse + zero).round().clamp(0, 255)
        two_roundings_differ += int((two_roundings != integers_alone)[clear].sum())
    assert two_roundings_differ > 0  # the data has the values the two differ on


def attention(n_in: int, cross: bool = False) -> torch.nn.Module:
    """A module holding int8 q/k/v projections (BART's names; inside a layer as ``encoder_attn`` when
    ``cross``) and an output projection."""
    block = torch.nn.Module()
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "out_proj")):
        torch.manual_seed(i)
        linear = torch.nn.Linear(n_in, 48 + 16 * i)
        linear.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            setattr(block, name, optimize.Int8Linear.from_float(linear))
    if not cross:
        return block
    layer = torch.nn.Module()
    layer.encoder_attn = block
    return layer


def test_projections_of_one_input_share_one_int8_call_bit_for_bit():
    block = attention(96)
    x = rows(5, 96, 3).view(5, 1, 96)
    names = ("q_proj", "k_proj", "v_proj")
    before = [getattr(block, name)(x) for name in names]
    with optimize.rows_apart():
        before_apart = [getattr(block, name)(x) for name in names]
    assert optimize.share_inputs(block) == 1
    fused = block.q_proj.quantized
    assert block.k_proj.quantized is fused and block.v_proj.quantized is fused
    assert block.out_proj.quantized is not fused and block.out_proj.columns is None
    assert [block.q_proj.out_features, block.k_proj.out_features, block.v_proj.int8_bytes()] == [48, 64, 80 * 96]
    assert all(torch.equal(getattr(block, name)(x), want) for name, want in zip(names, before))
    with optimize.rows_apart():
        assert all(torch.equal(getattr(block, name)(x), want) for name, want in zip(names, before_apart))
    # Any order, a layer called twice, or on another tensor: each gets its own columns of the right input.
    other = rows(5, 96, 4).view(5, 1, 96)
    assert torch.equal(block.v_proj(x), before[2]) and torch.equal(block.v_proj(x), before[2])
    q = block.q_proj(x)
    q.add_(1.0)  # a caller changing its result in place (LoRA adds its update so) changes no one else's
    assert torch.equal(block.k_proj(x), before[1])
    assert torch.equal(block.k_proj(other), fused(other)[..., 48:112])  # the columns of its own input


def test_a_cross_attention_shares_its_key_and_value_only():
    layer = attention(64, cross=True)
    assert optimize.share_inputs(layer) == 1
    block = layer.encoder_attn
    assert block.q_proj.columns is None and block.k_proj.quantized is block.v_proj.quantized
    assert (block.k_proj.columns, block.v_proj.columns) == ((0, 64), (64, 144))


def test_a_model_with_shared_inputs_gives_the_logits_of_one_without(monkeypatch):
    """The int8 demo model as served (its attentions' projections sharing calls) against the same
    model quantized without sharing: the same logits, bit for bit, alone and rows apart."""
    from chat.engine import DEMO_DIR, load_checkpoint

    shared = load_checkpoint(str(DEMO_DIR), optimize="int8").model
    monkeypatch.setattr(optimize, "share_inputs", lambda model: 0)
    separate = load_checkpoint(str(DEMO_DIR), optimize="int8").model
    layers = [m for m in shared.modules() if isinstance(m, optimize.Int8Linear)]
    assert sum(m.columns is not None for m in layers) > 0
    assert all(m.columns is None for m in separate.modules() if isinstance(m, optimize.Int8Linear))
    ids = torch.randint(5, shared.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    decoder = torch.randint(5, shared.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for context in (contextlib.nullcontext, optimize.rows_apart):
            with context():
                want = separate(input_ids=ids, decoder_input_ids=decoder).logits
                got = shared(input_ids=ids, decoder_input_ids=decoder).logits
            assert torch.equal(got, want)
