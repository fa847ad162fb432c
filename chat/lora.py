"""peft's LoRA linear layer with a lean forward for CPU serving, the same numbers as peft's.

An unmerged LoRA adapter adds two small products to each wrapped projection (rank 8 or 16 against
1,280 features): arithmetic that costs a few microseconds. What costs more on a CPU is peft's
general forward around them: checks for merged weights, mixed batches and LoRA variants, and four
module calls (dropout, A, B, the base layer) per projection. With ~100 projections per decoder
step of the 400M model, that doubled a 0.1 ms int8 projection and made an adapter's reply ~35%
slower than its base's (docs/chat-benchmarks.md).

``ServedLoraLinear`` takes a straight path for the two cases serving needs: no adapter active in the
layer (the base serving beside its adapters: the base layer alone), and one active, plain LoRA
adapter in eval mode, fp32 on the CPU. ``result + (x A^T) B^T * scaling`` becomes one ``addmm``
with ``alpha=scaling`` over peft's own tensors, which gives the same bits as peft's
``result + lora_B(lora_A(x)) * scaling`` (the same MKL products; tests/chat/test_serving.py checks
replies token for token against peft's PeftModel). Everything else (several adapters, DoRA and the
other variants, mixed batches, bf16, the GPU, where CUDA graphs absorb the Python) goes through
peft's forward. Installed with peft's custom-module hook (``LoraConfig._register_custom_module``)
by ``chat.serving.Host.attach``, so peft builds it wherever it would build its own Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear


class ServedLoraLinear(Linear):
    """peft's LoRA ``Linear``, with a lean forward for one plain adapter in fp32 on the CPU."""

    lean = True  # tests turn it off to compare with peft's own forward

    def _lean_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """The adapter the lean path serves this call with, or None when peft's forward must."""
        if not self.lean or args or kwargs or self.disable_adapters or self.merged or self.training:
            return None
        active = self.active_adapters
        if len(active) != 1:
            return None
        name = active[0]
        if name not in self.lora_A or name in self.lora_variant or self.lora_bias.get(name, False):
            return None
        weight = self.lora_A[name].weight
        if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (
            self.lean
            and not (args or kwargs or self.merged)
            and not any(a in self.lora_A for a in self.active_adapters)
        ):
            return self.base_layer(x)  # no adapter of this layer active (the base serving): peft's result
        name = self._lean_adapter(x, args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        down = F.linear(x.reshape(-1, x.shape[-1]), self.lora_A[name].weight)  # dropout: identity in eval
        flat = torch.addmm(
            result.reshape(-1, result.shape[-1]), down, self.lora_B[name].weight.t(), alpha=self.scaling[name]
        )
        return flat.view(result.shape)
