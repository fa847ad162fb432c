"""peft's LoRA linear layer with a lean forward for CPU serving, the same numbers as peft's.

An unmerged LoRA adapter adds two small products to each wrapped projection (rank 8 or 16 against
1,280 features): arithmetic that costs a few microseconds. What costs more on a CPU is peft's
general forward around them: checks for merged weights, mixed batches and LoRA variants, and four
module calls (dropout, A, B, the base layer) per projection. With ~100 projections per decoder
step of the 400M model, that made an int8 adapter's reply ~35-40% slower than its base's
(docs/chat-benchmarks.md).

``ServedLoraLinear`` takes a straight path for the two cases serving needs, decided once each time
the layer's adapters change (``_plan``), not on every call:

* no adapter of this layer active (the base serving beside its adapters): the base layer alone;
* one active, plain LoRA adapter, fp32 on the CPU, in eval mode: ``result + (x A^T) B^T *
  scaling`` as one ``addmm`` with ``alpha=scaling`` over peft's own tensors, which gives the same
  bits as peft's ``result + lora_B(lora_A(x)) * scaling`` (the same MKL products;
  tests/chat/test_serving.py checks replies token for token against peft's PeftModel, and logits
  bit for bit against peft's own forward on the int8 base).

Inside ``by_lanes`` (the GPU's slots, ``chat.stepgraphs``) every row of a batch goes through its own
adapter from the layer's adapters stacked by lane: two dense products, the same for any mix of rows,
so a recorded CUDA graph serves any mix. Everything else (several adapters, DoRA and the other
variants, mixed batches of the CPU's step loop, bf16, training) goes through peft's forward.
Installed with peft's custom-module hook (``LoraConfig._register_custom_module``) by
``chat.serving.Host.attach``, so peft builds it wherever it would build its own Linear.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear

from chat.optimize import Int8Linear

_PEFT = ("peft",)  # this layer's calls go through peft's forward
BASE = "__base__"  # peft's name for a row that no adapter changes
# Inside ``rows_of``: the adapter of each row of the batch (chat.stepping's mixed steps).
_ROWS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("lora_rows", default=None)
# Inside ``by_lanes``: (the host's lanes, the rank each lane's block holds, each row's 0/1 block mask).
_LANES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("lora_lanes", default=None)


@contextmanager
def rows_of(names: list[str | None]):
    """Calls inside run row ``i`` of every input through adapter ``names[i]`` (None: the base
    alone), whatever is active: peft's mixed-batch forward (``adapter_names``), which adds each
    adapter's low-rank product to its own rows only, as S-LoRA and Punica do for decoder models."""
    token = _ROWS.set(tuple(BASE if name is None else name for name in names))
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def by_lanes(lanes: tuple[str | None, ...], rank: int, mask: torch.Tensor):
    """Calls inside run each row of every input through its own adapter with no Python per adapter,
    so that one recorded CUDA graph serves any mix of adapters (chat.stepgraphs' mixed steps).

    ``lanes`` are the host's adapters by lane (``chat.serving.Host``; lane 0, the base, has none);
    each layer stacks their A matrices into one (lanes-1) * ``rank`` x in matrix and their B
    matrices, times the adapter's scaling, into one out x (lanes-1) * ``rank`` matrix (a lane's
    block zero-padded to ``rank``; zero where the adapter leaves the layer alone). ``mask`` (rows x
    (lanes-1) * ``rank``, the layer's dtype) is 1 on a row's own lane's block, else 0: the update
    ``((x A^T) * mask) B^T`` is each row's own adapter's, exact zeros for the base's rows (the
    gathered products of S-LoRA and Punica, as two dense products with a small inner size)."""
    token = _LANES.set((lanes, rank, mask))
    try:
        yield
    finally:
        _LANES.reset(token)


def lane_mask(lane: torch.Tensor, lanes: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``by_lanes``' mask for rows in lanes ``lane`` (a device tensor, 0 for the base)."""
    blocks = torch.arange(rank * (lanes - 1), device=lane.device) // rank + 1
    return (lane[:, None] == blocks[None, :]).to(dtype)


def stack_all(model, lanes: tuple[str | None, ...], rank: int) -> None:
    """Make every layer's stacks for ``by_lanes`` now, on the current stream: not inside a recording's
    warm-up, whose side stream would own their memory while the main stream's replays read it."""
    for module in model.modules():
        if isinstance(module, ServedLoraLinear) and module.lora_A:
            module._stacks(lanes, rank)


def stackable(layer: Linear, name: str) -> bool:
    """Is adapter ``name`` of this layer plain LoRA (no variant such as DoRA, no bias of its own), the
    kind ``by_lanes`` and the lean single-adapter forward serve?"""
    return name not in layer.lora_variant and not layer.lora_bias.get(name, False)


class ServedLoraLinear(Linear):
    """peft's LoRA ``Linear``, with a lean forward for the base alone or one plain fp32 CPU adapter."""

    lean = True  # tests turn it off to compare with peft's own forward

    def _replan(self) -> tuple:
        """What calls run until the adapters change: ("base", layer), ("lora", layer, A, B^T,
        scaling), or ("peft",)."""
        plan = self._decide()
        self.__dict__["_plan"] = plan
        return plan

    def _decide(self) -> tuple:
        if not self.lean or self.merged:
            return _PEFT
        base = self.get_base_layer()
        # An int8 layer's forward needs no module call around it (no hooks on these shells): call it
        # directly (each row on its own scale inside rows_apart; its columns of a shared call).
        base = base.forward if isinstance(base, Int8Linear) else base
        active = [name for name in self.active_adapters if name in self.lora_A]
        if self.disable_adapters or not active:
            return ("base", base)
        if len(active) != 1:
            return _PEFT
        name = active[0]
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        on_cpu = a.device.type == b.device.type == "cpu" and a.dtype == b.dtype == torch.float32
        return ("lora", base, a, b.t(), self.scaling[name]) if stackable(self, name) and on_cpu else _PEFT

    def _invalidate(self) -> None:
        self.__dict__["_plan"] = None
        self.__dict__["_stacked"] = None

    def _stacks(self, lanes: tuple, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's adapters by lane for ``by_lanes``: stacked A and scaled B (made once per set
        of lanes; any change to the adapters makes them again)."""
        made = self.__dict__.get("_stacked")
        if made is not None and made[0] == (lanes, rank):
            return made[1]
        weight = next(iter(self.lora_A.values())).weight  # the adapters' dtype and place (as peft's forward)
        a = torch.zeros((len(lanes) - 1) * rank, self.in_features, dtype=weight.dtype, device=weight.device)
        b = torch.zeros(self.out_features, (len(lanes) - 1) * rank, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            for lane, name in enumerate(lanes[1:]):
                if name in self.lora_A:
                    r = self.r[name]
                    a[lane * rank : lane * rank + r] = self.lora_A[name].weight
                    b[:, lane * rank : lane * rank + r] = self.lora_B[name].weight * self.scaling[name]
        self.__dict__["_stacked"] = ((lanes, rank), (a, b))
        return a, b

    # Whatever changes the adapters, their tensors or the module's place makes a new plan.
    def set_adapter(self, *args, **kwargs):
        self._invalidate()
        return super().set_adapter(*args, **kwargs)

    def enable_adapters(self, enabled: bool) -> None:
        self._invalidate()
        super().enable_adapters(enabled)

    def delete_adapter(self, adapter_name: str) -> None:
        self._invalidate()
        super().delete_adapter(adapter_name)

    def update_layer(self, *args, **kwargs):
        self._invalidate()
        return super().update_layer(*args, **kwargs)

    def merge(self, *args, **kwargs) -> None:
        self._invalidate()
        super().merge(*args, **kwargs)

    def unmerge(self) -> None:
        self._invalidate()
        super().unmerge()

    def _load_from_state_dict(self, *args, **kwargs):
        self._invalidate()  # an adapter's tensors may be replaced (peft loads with assign=True)
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self._invalidate()  # .to() / .float(): the tensors may move
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        lanes = _LANES.get()
        if lanes is not None and not args and not kwargs and self.lora_A:
            a, b = self._stacks(lanes[0], lanes[1])
            result = self.get_base_layer()(x)
            down = F.linear(x.to(a.dtype), a)
            mask = lanes[2].to(a.dtype).view(len(x), *([1] * (x.dim() - 2)), -1)  # a row's, for each token
            return result + F.linear(down * mask, b).to(result.dtype)
        rows = _ROWS.get()
        if rows is not None and not args and not kwargs and len(rows) == len(x):
            return super().forward(x, adapter_names=list(rows))
        plan = self.__dict__.get("_plan") or self._replan()
        kind = plan[0]
        if kind == "peft" or args or kwargs:
            return super().forward(x, *args, **kwargs)
        if kind == "base":
            return plan[1](x)  # peft's result with no adapter of this layer active
        if self.training or x.dtype != torch.float32:  # dropout would drop; a cast peft makes
            return super().forward(x, *args, **kwargs)
        _, base, a, b_t, scaling = plan
        result = base(x)
        down = F.linear(x.reshape(-1, x.shape[-1]), a)  # dropout: the identity in eval mode
        if result.requires_grad or not result.is_contiguous():
            return torch.addmm(result.reshape(-1, result.shape[-1]), down, b_t, alpha=scaling).view(result.shape)
        flat = result.view(-1, result.shape[-1])
        flat.addmm_(down, b_t, alpha=scaling)  # in place: the base layer's fresh output, one allocation less
        return result
