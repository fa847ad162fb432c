"""peft's LoRA Linear layer with a leaner training forward: same results, less memory and traffic.

peft computes ``result + lora_B(lora_A(dropout(x))) * scaling``. For every wrapped projection that
is, besides the frozen base's matrix product: a dropped copy of the input and its mask, both kept
for the backward pass (q, k and v each keep their own copy of the same layer-norm output, and
cross-attention's k and v each a copy of the encoder output, in every decoder layer), the B
product written out, a scaled copy of it, and a sum: four passes over the projection's output
that the frozen base (no weight gradient) does not need. On 400M-sized batches these passes and
copies are what made peft's LoRA slower than full fine-tuning on a GPU, and its default dropout
nearly doubles the activations (finetune/memory.py counts them).

``FusedLinear`` (``fuse`` turns a peft model's LoRA Linear layers into it) computes the same thing:

* ``torch.addmm(result, h, B^T, alpha=scaling)``: the scaled B product added into the base's
  output by one matrix product, no intermediate output-sized tensors, and none in the backward
  pass either (the scaling goes to the rank-r gradients);
* on a GPU, with a LoRA dropout, ``h = A(dropout(x))`` is finetune/lora_dropout.py's Triton
  kernels: the mask is drawn inside each kernel from a hash of (seed, element) and never stored,
  so only ``x`` (which the rest of the layer keeps anyway) and the rank-r ``h`` are held, and no
  dropped copy of ``x`` is written or read. With a plain ``nn.Linear`` base the whole layer is
  then one autograd function (``LoraLinear``), so that the input's gradient is written once: the
  base's product adds onto the LoRA path's instead of autograd summing two written copies.
* Without Triton (or under autocast) the same product runs under activation checkpointing: the
  backward pass recomputes the dropped input from the saved RNG state. On a CPU drawing the mask
  is what costs (about a fifth of the base projection's matrix product on 1,024 tokens), so it is
  drawn once and kept, as peft does.

Anything else (merged or disabled adapters, several active adapters, DoRA and other variants,
ZeRO-3's partitioned weights that only a module call gathers) goes to peft's own forward. The
layer's parameters, their names and the saved adapter are peft's: only the arithmetic's order differs.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear
from torch import nn
from torch.utils.checkpoint import checkpoint

from finetune import lora_dropout

RECOMPUTE_DROPOUT_ON = ("cuda",)  # device types where the dropped input is recomputed, not kept


def recompute(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.device.type in RECOMPUTE_DROPOUT_ON


def _down(x: torch.Tensor, dropout: nn.Module, lora_a: nn.Module) -> torch.Tensor:
    return lora_a(dropout(x))


class FusedLinear(Linear):
    """peft's ``lora.Linear`` with the training forward described above (module docstring)."""

    def _plain_case(self, args, kwargs) -> str | None:
        """The one active adapter when this forward applies to it, else None (peft's forward)."""
        if self.disable_adapters or self.merged or args or kwargs or self.fan_in_fan_out:
            return None
        active = self.active_adapters
        if len(active) != 1 or active[0] not in self.lora_A or active[0] in self.lora_variant:
            return None
        name = active[0]
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        if hasattr(a, "ds_id") or hasattr(b, "ds_id"):  # ZeRO-3: only calling the module gathers its weight
            return None
        same = a.dtype == b.dtype == self.get_base_layer().weight.dtype
        return name if same or torch.is_autocast_enabled(a.device.type) else None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._plain_case(args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        lora_a, lora_b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        x = self._cast_input_dtype(x, lora_a.weight.dtype)
        p = dropout.p if isinstance(dropout, nn.Dropout) else 0.0 if isinstance(dropout, nn.Identity) else None
        if p is not None and self.training and recompute(x) and _whole_layer(base, lora_a, lora_b, x, p):
            args = (base.weight, base.bias, lora_a.weight, lora_b.weight, self.scaling[name], p)
            return LoraLinear.apply(x, *args, lora_dropout.new_seed() if p > 0 else 0)
        if isinstance(dropout, nn.Dropout) and p > 0 and self.training and recompute(x):
            if lora_a.bias is None and lora_dropout.available(x, lora_a.weight):
                h = lora_dropout.dropped_down(x, lora_a.weight, p)  # the mask drawn in the kernels
            else:
                h = checkpoint(_down, x, dropout, lora_a, use_reentrant=False)  # the mask is recomputed, not kept
        else:
            h = lora_a(dropout(x))
        result = base(x)
        flat = result.reshape(-1, result.shape[-1])
        out = torch.addmm(flat, h.reshape(-1, h.shape[-1]), lora_b.weight.t(), alpha=self.scaling[name])
        return out.view(result.shape)


def _whole_layer(base: nn.Module, lora_a: nn.Module, lora_b: nn.Module, x: torch.Tensor, p: float) -> bool:
    """Whether ``LoraLinear`` computes this layer: a plain Linear base and bias-free LoRA weights of
    x's dtype on a GPU (no autocast), and the dropout kernels where there is a dropout."""
    return (
        type(base) is nn.Linear
        and lora_a.bias is None
        and lora_b.bias is None
        and x.is_cuda
        and base.weight.dtype == lora_a.weight.dtype == x.dtype
        and not torch.is_autocast_enabled("cuda")
        and (p == 0 or lora_dropout.available(x, lora_a.weight))
    )


class LoraLinear(torch.autograd.Function):
    """``x @ W^T + bias + scaling * (dropout(x) @ A^T) @ B^T`` on a GPU, the dropout drawn in
    finetune/lora_dropout.py's kernels (p = 0: plain products, no kernels, and ``seed`` unused),
    with each output-sized and input-sized tensor written once:
    the B product is added into the base's output in place, and in the backward pass the base's
    input gradient is added onto the LoRA path's by the same matrix product (cuBLAS's beta = 1),
    where autograd would write both and then a third tensor with their sum. Only ``x`` (which the
    caller keeps anyway) and the rank-r ``h`` are saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, p: float, seed: int):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        h = lora_dropout.down(x2, lora_a.contiguous(), p, seed) if p > 0 else x2 @ lora_a.t()
        out = torch.nn.functional.linear(x2, weight, bias)
        out.addmm_(h, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, h)
        ctx.scaling, ctx.p, ctx.seed, ctx.shape, ctx.has_bias = scaling, p, seed, x.shape, bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0]).to(x2.dtype)
        gh = torch.mm(g, lora_b) * ctx.scaling  # the gradient of h: (rows, rank)
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.p > 0:
                grad_x = lora_dropout.down_grad_input(gh, lora_a.contiguous(), ctx.p, ctx.seed)
            else:
                grad_x = gh @ lora_a
            grad_x = grad_x.addmm_(g, weight).view(ctx.shape)  # + the base's, in the same product
        if ctx.needs_input_grad[1]:  # a trainable base (not LoRA's usual frozen one)
            grad_w = g.t() @ x2
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        if ctx.needs_input_grad[3]:
            if ctx.p > 0:
                grad_a = lora_dropout.down_grad_weight(x2, gh, lora_a, ctx.p, ctx.seed)
            else:
                grad_a = gh.t() @ x2
        if ctx.needs_input_grad[4]:
            grad_b = (g.t() @ h) * ctx.scaling
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None


def fuse(model: nn.Module) -> int:
    """Make every peft LoRA Linear layer of ``model`` a ``FusedLinear`` (its class only: weights,
    names and adapters stay); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLinear
            count += 1
    return count
