"""LoRA's dropped down projection in Triton (finetune/lora_dropout.py), on a GPU: the three kernels
draw the same mask (each element kept with probability 1 - p, a seed repeats it, another seed
does not), the product and both gradients equal PyTorch's on that mask, and a LoRA layer in
training takes this path and repeats under torch.manual_seed."""

import pytest
import torch

from finetune import lora_dropout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or lora_dropout.triton is None, reason="needs a CUDA GPU and Triton"
    ),
]


def keep_mask(n_rows: int, n_cols: int, p: float, seed: int, device) -> torch.Tensor:
    """The (rows, features) keep mask the kernels draw for ``seed``: the forward pass of ones through
    one-hot rows of A reads it out, up to 16 features at a time."""
    ones = torch.ones(n_rows, n_cols, device=device)
    out = torch.empty(n_rows, n_cols, dtype=torch.bool, device=device)
    for start in range(0, n_cols, 16):
        width = min(16, n_cols - start)
        pick = torch.zeros(width, n_cols, device=device)
        pick[torch.arange(width), start + torch.arange(width)] = 1.0
        out[:, start : start + width] = lora_dropout.DroppedDown.apply(ones, pick, float(p), int(seed)) > 0
    return out


def test_the_mask_keeps_each_element_with_probability_one_minus_p_and_repeats_with_its_seed():
    mask = keep_mask(2048, 1280, 0.05, 11, "cuda")
    dropped = (~mask).float()
    assert dropped.mean().item() == pytest.approx(0.05, abs=0.002)  # 2.6M elements: sd 0.00014
    # neighbours in a row and in a column are dropped independently
    both_rows = (dropped[1:] * dropped[:-1]).mean() / dropped.mean() ** 2
    both_cols = (dropped[:, 1:] * dropped[:, :-1]).mean() / dropped.mean() ** 2
    assert both_rows.item() == pytest.approx(1, abs=0.05) and both_cols.item() == pytest.approx(1, abs=0.05)
    half = lora_dropout.BLOCK_K // 2  # partners: the two halves of one hash
    partners = (dropped[:, half:] * dropped[:, :-half]).mean() / dropped.mean() ** 2
    assert partners.item() == pytest.approx(1, abs=0.05)
    assert torch.equal(mask, keep_mask(2048, 1280, 0.05, 11, "cuda"))
    other = keep_mask(2048, 1280, 0.05, 12, "cuda")
    assert ((~mask) & (~other)).float().mean().item() == pytest.approx(0.05**2, abs=0.0005)


@pytest.mark.parametrize(
    "shape, rank, p, dtype, tol",
    [
        ((3, 45, 200), 8, 0.1, torch.float32, 1e-4),  # rows and features that fill no block
        ((1000, 1280), 16, 0.05, torch.float32, 1e-4),
        ((8, 128, 1280), 8, 0.05, torch.bfloat16, 2e-2),
        ((4, 64, 5120), 4, 0.3, torch.bfloat16, 2e-2),
    ],
)
def test_the_product_and_its_gradients_equal_pytorchs_on_the_same_mask(shape, rank, p, dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    a = (torch.randn(rank, shape[-1], device="cuda") / shape[-1] ** 0.5).to(dtype).requires_grad_(True)
    grad = torch.randn(*shape[:-1], rank, device="cuda", dtype=dtype)
    h = lora_dropout.dropped_down(x, a, p, seed=1234)
    h.backward(grad)

    keep = keep_mask(x[..., 0].numel(), shape[-1], p, 1234, "cuda").view(shape)
    x32, a32 = x.detach().float().requires_grad_(True), a.detach().float().requires_grad_(True)
    want = (x32 * keep * lora_dropout.threshold(p)[1]) @ a32.t()
    want.backward(grad.float())

    def close(got, ref):
        return (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())

    assert h.shape == (*shape[:-1], rank) and h.dtype == dtype
    assert close(h, want) and close(x.grad, x32.grad) and close(a.grad, a32.grad)
    assert torch.equal(x.grad == 0, ~keep | (x32.grad == 0))  # a dropped element gets no gradient


def test_a_lora_layer_in_training_uses_the_kernels_and_repeats_under_manual_seed():
    from peft import LoraConfig, get_peft_model

    from finetune.lora_layer import LoraLinear, fuse

    def step(seed: int):
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["0", "2"]))
        fuse(model)
        model.cuda().to(torch.bfloat16).train()
        for module in model.modules():  # B starts at zero: give it values so A's gradient is not zero
            if hasattr(module, "lora_B"):
                torch.nn.init.normal_(module.lora_B["default"].weight)
        x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(seed)  # the masks' seeds come from here
        model(x).float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    calls = []
    original = LoraLinear.forward
    LoraLinear.forward = staticmethod(lambda *a: calls.append(1) or original(*a))
    try:
        first, again, other = step(1), step(1), step(2)
    finally:
        LoraLinear.forward = staticmethod(original)
    assert len(calls) == 6  # two LoRA layers, three steps
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first if "lora_A" in n)


@pytest.mark.parametrize(
    "dtype, tol, p", [(torch.float32, 1e-4, 0.05), (torch.bfloat16, 3e-2, 0.05), (torch.bfloat16, 3e-2, 0.0)]
)
def test_the_fused_lora_layer_equals_its_parts_on_the_same_mask(dtype, tol, p):
    """LoraLinear (base product, dropped down projection, B product; the input's two gradients added
    by one product) against the same arithmetic written out in fp32 with the kernels' mask (p = 0:
    no kernels, no mask)."""
    from finetune.lora_layer import LoraLinear

    torch.manual_seed(0)
    rows, n_in, n_out, rank, scaling = 300, 1280, 640, 8, 2.0

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_(True)

    x, w, bias = leaf(3, rows // 3, n_in), leaf(n_out, n_in, scale=n_in**-0.5), leaf(n_out)
    a, b = leaf(rank, n_in, scale=n_in**-0.5), leaf(n_out, rank)
    grad = torch.randn(3, rows // 3, n_out, device="cuda").to(dtype)
    out = LoraLinear.apply(x, w, bias, a, b, scaling, p, 77)
    out.backward(grad)

    keep = keep_mask(rows, n_in, p, 77, "cuda").view(x.shape) if p else torch.ones_like(x, dtype=torch.bool)
    ref = [t.detach().float().requires_grad_(True) for t in (x, w, bias, a, b)]
    x32, w32, bias32, a32, b32 = ref
    dropped = x32 * keep * lora_dropout.threshold(p)[1]
    want = x32 @ w32.t() + bias32 + scaling * (dropped @ a32.t()) @ b32.t()
    want.backward(grad.float())

    def close(got, ref):
        return (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())

    assert out.dtype == dtype and close(out, want)
    for got, ref_leaf in zip((x, w, bias, a, b), ref):
        assert close(got.grad, ref_leaf.grad)


def test_a_lora_layer_without_dropout_also_trains_as_one_function_and_draws_no_seed():
    from peft import LoraConfig, get_peft_model

    from finetune.lora_layer import LoraLinear, fuse

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["0"]))
    fuse(model)
    model.cuda().train()
    calls = []
    original = LoraLinear.forward
    LoraLinear.forward = staticmethod(lambda *a: calls.append(a[-1]) or original(*a))
    try:
        state = torch.get_rng_state()
        model(torch.randn(4, 64, device="cuda")).sum().backward()
    finally:
        LoraLinear.forward = staticmethod(original)
    assert calls == [0] and torch.equal(torch.get_rng_state(), state)
