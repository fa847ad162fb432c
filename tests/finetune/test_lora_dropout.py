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
    want = (x32 * keep / (1 - p)) @ a32.t()
    want.backward(grad.float())

    def close(got, ref):
        return (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())

    assert h.shape == (*shape[:-1], rank) and h.dtype == dtype
    assert close(h, want) and close(x.grad, x32.grad) and close(a.grad, a32.grad)
    assert torch.equal(x.grad == 0, ~keep | (x32.grad == 0))  # a dropped element gets no gradient


def test_a_lora_layer_in_training_uses_the_kernels_and_repeats_under_manual_seed():
    from peft import LoraConfig, get_peft_model

    from finetune.lora_layer import fuse

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
    original = lora_dropout.DroppedDown.forward
    lora_dropout.DroppedDown.forward = staticmethod(lambda *a: calls.append(1) or original(*a))
    try:
        first, again, other = step(1), step(1), step(2)
    finally:
        lora_dropout.DroppedDown.forward = staticmethod(original)
    assert len(calls) == 6  # two LoRA layers, three steps
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first if "lora_A" in n)
