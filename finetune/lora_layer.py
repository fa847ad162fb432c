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
  dropped copy of ``x`` is written or read. Without Triton (or under autocast) the same product
  runs under activation checkpointing: the backward pass recomputes the dropped input from the
  saved RNG state. On a CPU drawing the mask is what costs (about a fifth of the base projection's
  matrix product on 1,024 tokens), so it is drawn once and kept, as peft does.

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
        result = self.base_layer(x)
        lora_a, lora_b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        x = self._cast_input_dtype(x, lora_a.weight.dtype)
        if isinstance(dropout, nn.Dropout) and dropout.p > 0 and self.training and recompute(x):
            if lora_a.bias is None and lora_dropout.available(x, lora_a.weight):
                h = lora_dropout.dropped_down(x, lora_a.weight, dropout.p)  # the mask drawn in the kernels
            else:
                h = checkpoint(_down, x, dropout, lora_a, use_reentrant=False)  # the mask is recomputed, not kept
        else:
            h = lora_a(dropout(x))
        flat = result.reshape(-1, result.shape[-1])
        out = torch.addmm(flat, h.reshape(-1, h.shape[-1]), lora_b.weight.t(), alpha=self.scaling[name])
        return out.view(result.shape)


def fuse(model: nn.Module) -> int:
    """Make every peft LoRA Linear layer of ``model`` a ``FusedLinear`` (its class only: weights,
    names and adapters stay); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLinear
            count += 1
    return count
