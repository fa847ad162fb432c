"""How much GPU memory a training run needs per GPU, the largest micro-batch that fits, and a
rough time per epoch: ``--per_device_train_batch_size auto`` and the Train tab's pre-flight line.

Peak memory per GPU = a static part (weights, gradients and optimizer state, by strategy and
precision) + rows x memory per row (the activations autograd keeps for the backward pass, by
source/target length). Both are counted from the architecture (what each layer saves) and then
scaled by constants calibrated on the H200 runs of ``bench.train`` (docs/benchmarks.md): the
counts give the shape (how memory grows with lengths, layers, width), the measured peaks the
scale. The numbers are ``torch.cuda.max_memory_allocated``; the fit fraction (92% of the card)
leaves room for the CUDA context, the allocator's caching and fragmentation.

No torch import at module level: the web UI computes pre-flight lines without loading torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

GIB = 2**30
FIT_FRACTION = 0.92  # of the GPU's total memory that 'auto' fills with the estimated peak
CPU_BATCH = 8  # 'auto' without a GPU: host memory is not the limit, CPU speed is
MULTIPLE = 8  # 'auto' picks a multiple of this (tensor-core friendly; matches pad_to_multiple_of)
STRATEGIES = ("zero2", "ddp", "single", "zero3_offload")

# Calibration (one H200, 2026-12-01, torch 2.11, DeepSpeed 0.19.8; docs/benchmarks.md "Memory
# model"): the measured per-row slope between two batch sizes / the counted bytes per row, for a
# model held in 16 bits by DeepSpeed ("ds": 800 -> 1,600 rows, 56.5 -> 108.0 GiB) and for fp32
# weights under autocast ("amp", accelerate's native AMP: 400 -> 800 rows, 38.4 -> 71.8 GiB),
# where layer norms, residuals and the loss keep fp32 copies.
ACTIVATION_SCALE = {"ds": 0.98, "amp": 1.27, "fp32": 1.27}
# The measured intercepts (5.06 and 4.96 GiB) minus the counted state: workspaces, the cuBLAS handle.
STATIC_OVERHEAD_GIB = 0.3
FP16_EXTRA_GIB = 0.5  # DeepSpeed's fp16 loss scaling (overflow checks): seed fp16 57.0 vs bf16 56.5 GiB at 800
# Sustained training FLOP rate per GPU (FLOPs per sample as bench/train_runs.py counts them),
# measured by bench.train on fixed 128/64 rows; None elsewhere, so no time is guessed.
MEASURED_FLOPS = {("H200", "ds"): 383e12, ("H200", "amp"): 310e12}


class BatchTooLarge(ValueError):
    """A micro-batch that the memory model says will not fit; the message names one that does."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a BlenderBot-style encoder-decoder."""

    params: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    ffn_dim: int
    heads: int
    vocab: int

    @classmethod
    def from_config(cls, config, params: int | None = None) -> ModelShape:
        """From a transformers config (``params`` counted from the model when it is loaded)."""
        d, ffn, vocab = config.d_model, config.decoder_ffn_dim, config.vocab_size
        enc, dec = config.encoder_layers, config.decoder_layers
        if params is None:  # weights of the layers, the shared embedding and the positions
            enc_layer = 4 * d * d + 2 * d * config.encoder_ffn_dim
            dec_layer = 8 * d * d + 2 * d * ffn
            params = enc * enc_layer + dec * dec_layer + vocab * d + 2 * config.max_position_embeddings * d
        return cls(params, d, enc, dec, ffn, config.decoder_attention_heads, vocab)

    @classmethod
    def of(cls, name_or_path: str) -> ModelShape:
        """The shape of a preset, local checkpoint or Hub id (reads only its config)."""
        from transformers import AutoConfig

        from chat.model import resolve

        return cls.from_config(AutoConfig.from_pretrained(resolve(name_or_path)))

    @classmethod
    def local(cls, name_or_path: str) -> ModelShape | None:
        """The shape from config.json alone, never downloading or building anything: a preset (its
        built folder, else its recipe), a model folder, or a Hub id already in the local Hugging
        Face cache; None when no such config is on this machine (the caller says the estimate is
        unavailable). Cheap: for the Train tab's pre-flight line at each change of the form."""
        import json
        from types import SimpleNamespace

        from chat.model import MAX_POSITIONS, MODEL_PRESETS, TOKENIZER_VOCAB, cache_dir

        name = name_or_path.strip()
        if name in MODEL_PRESETS:
            path = cache_dir() / f"{name}-blenderbot" / "config.json"
            if not path.is_file():  # not built yet: its recipe (the tokenizer's vocabulary is about TOKENIZER_VOCAB)
                recipe = {
                    "vocab_size": TOKENIZER_VOCAB,
                    "max_position_embeddings": MAX_POSITIONS,
                    **MODEL_PRESETS[name],
                }
                return cls.from_config(SimpleNamespace(**recipe))
        elif Path(name).is_dir():
            path = Path(name) / "config.json"
        else:
            from huggingface_hub import try_to_load_from_cache

            try:
                found = try_to_load_from_cache(name, "config.json")
            except ValueError:  # not a valid repo id
                return None
            if not isinstance(found, str):  # not cached, or cached as missing
                return None
            path = Path(found)
        try:
            return cls.from_config(SimpleNamespace(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError, AttributeError):  # no file, not JSON, not an encoder-decoder's
            return None

    def projections(self) -> list[tuple[str, int, int, str]]:
        """Every projection LoRA can wrap, per layer of the model: (module name, in width, out width,
        the side whose tokens it sees: "source" or "target"). Cross-attention's k/v read the encoder."""
        d, ffn = self.d_model, self.ffn_dim
        attn = [(name, d, d) for name in ("q_proj", "k_proj", "v_proj", "out_proj")]
        feed = [("fc1", d, ffn), ("fc2", ffn, d)]
        encoder = [(*p, "source") for p in attn + feed]
        cross = [(n, i, o, "source" if n in ("k_proj", "v_proj") else "target") for n, i, o in attn]
        decoder = [(*p, "target") for p in attn + feed] + cross
        return encoder * self.encoder_layers + decoder * self.decoder_layers

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """Trainable weights of a LoRA adapter of rank ``r`` on the ``targets`` projections (A: r x in, B: out x r)."""
        return sum(r * (i + o) for name, i, o, _ in self.projections() if name in targets)

    def flops_per_sample(self, source_len: int, target_len: int) -> float:
        """6 x the weights each token passes through x the tokens (as bench/train_runs.py counts)."""
        d, ffn = self.d_model, self.ffn_dim
        enc = self.encoder_layers * (4 * d * d + 2 * d * ffn)
        dec = self.decoder_layers * (6 * d * d + 2 * d * ffn) + self.vocab * d  # self + cross Q/O, FFN, LM head
        cross_kv = self.decoder_layers * 2 * d * d
        return 6 * (enc * source_len + dec * target_len + cross_kv * source_len)


@dataclass(frozen=True)
class Setup:
    """How a run holds the model: strategy, precision, processes, lengths, attention kernels."""

    strategy: str = "zero2"  # zero2 | ddp | single (one process, no DeepSpeed) | zero3_offload
    precision: str = "bf16"  # bf16 | fp16 | no
    processes: int = 1
    source_len: int = 128
    target_len: int = 64
    attention: str = "sdpa"  # eager keeps the attention probabilities for the backward pass
    # A LoRA run (lora_r > 0): the base is frozen (no gradients, no optimizer state), and a LoRA
    # dropout keeps a copy of each wrapped projection's input and its mask for the backward pass.
    lora_r: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.precision not in ("bf16", "fp16", "no"):
            raise ValueError(f"precision must be bf16, fp16 or no, got {self.precision!r}")
        if min(self.processes, self.source_len, self.target_len) < 1:
            raise ValueError("processes, source_len and target_len must be >= 1")
        if self.lora_r < 0 or (self.lora_r and not self.lora_targets):
            raise ValueError("a LoRA setup needs lora_r >= 1 and target modules")

    @property
    def family(self) -> str:
        """How activations are stored: 16-bit model under DeepSpeed, autocast over fp32, or fp32."""
        if self.precision == "no":
            return "fp32"
        return "ds" if self.strategy in ("zero2", "zero3_offload") else "amp"


@dataclass(frozen=True)
class Estimate:
    peak_gib: float  # per GPU, at the asked batch
    max_batch: int  # the largest multiple of MULTIPLE whose peak stays within FIT_FRACTION (0: none)
    seconds_per_epoch: float | None  # None: no measured speed for this GPU, or no row count
    static_gib: float
    per_row_gib: float
    capacity_gib: float | None


def static_bytes(shape: ModelShape, setup: Setup) -> float:
    """Weights and optimizer state per GPU at the peak (Adam: two fp32 moments per weight).

    The peak comes at the start of the backward pass, when all activations are still held and
    the gradients do not exist yet (each one appears as its activations are freed), so gradients
    count only through the buckets DDP keeps for them; this matches the measured intercepts."""
    p, n = shape.params, setup.processes
    trained = trainable_params(shape, setup)  # (all of them, but for LoRA)
    extra = FP16_EXTRA_GIB * GIB if setup.precision == "fp16" and setup.family == "ds" else 0.0
    if setup.strategy == "zero2":  # 16-bit weights; fp32 master copy and moments partitioned
        held, per_trained = (4, 8 / n) if setup.precision == "no" else (2, (4 + 8) / n)
    elif setup.strategy == "zero3_offload":  # state on the CPU; live 16-bit weights on the GPU
        held, per_trained = (2 if setup.precision != "no" else 4), 0
    else:  # fp32 weights and moments everywhere; DDP adds its gradient buckets
        held, per_trained = 4, 8 + (4 if setup.strategy == "ddp" and n > 1 else 0)
        if setup.precision != "no":
            held += 2  # autocast's 16-bit weight copies, kept for the backward pass
    adapter = trained if setup.lora_r else 0  # (held beside the base's weights)
    return held * (p + adapter) + per_trained * trained + STATIC_OVERHEAD_GIB * GIB + extra


def trainable_params(shape: ModelShape, setup: Setup) -> int:
    """Weights that train: all of them, or a LoRA run's adapter (its own weights are also held)."""
    if not setup.lora_r:
        return shape.params
    return shape.lora_params(setup.lora_r, setup.lora_targets)


def activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """What one row keeps for the backward pass, counted tensor by tensor (2-byte activations,
    1-byte dropout masks) and scaled by the calibrated ACTIVATION_SCALE."""
    d, ffn, v, h = shape.d_model, shape.ffn_dim, shape.vocab, shape.heads
    s, t = setup.source_len, setup.target_len
    b = 4 if setup.precision == "no" else 2
    attn = 6 * b * d + d  # layer-norm in/out, q, k, v, attention output; dropout mask
    ffn_block = 2 * b * d + 2 * b * ffn + d  # layer-norm in/out, fc1 out, activation out; dropout mask
    cross = 4 * b * d + d  # layer-norm in/out, q, output (K/V come from the encoder, below)
    encoder = shape.encoder_layers * s * (attn + ffn_block)
    decoder = shape.decoder_layers * (t * (attn + cross + ffn_block) + s * 2 * b * d)
    embeddings = (s + t) * 4 * b * d
    loss = t * v * (b + 4 + 4 + 4)  # logits, fp32 copy, log-softmax, its gradient (at backward start)
    total = encoder + decoder + embeddings + loss
    if setup.attention == "eager":  # probabilities of every head: self, decoder self, cross
        total += b * h * (shape.encoder_layers * s * s + shape.decoder_layers * (t * t + t * s))
    if setup.lora_r:  # each wrapped projection keeps its rank-r activation (for B's gradient) and, with a
        # LoRA dropout, the dropped copy of its input and the mask (the input itself is kept either way)
        keep = b + 1 if setup.lora_dropout > 0 else 0
        for name, width, _, side in shape.projections():
            if name in setup.lora_targets:
                total += (s if side == "source" else t) * (width * keep + setup.lora_r * b)
    return total * ACTIVATION_SCALE[setup.family]


def estimate(
    shape: ModelShape,
    batch: int,
    setup: Setup,
    capacity_gib: float | None = None,
    gpu_name: str | None = None,
    train_rows: int | None = None,
) -> Estimate:
    """Peak GPU memory per GPU at ``batch`` rows, the largest batch that fits ``capacity_gib``
    (0 without one) and, where this GPU's speed was measured, seconds per epoch of ``train_rows``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    static, per_row = static_bytes(shape, setup), activation_bytes(shape, setup)
    max_batch = 0
    if capacity_gib:
        room = FIT_FRACTION * capacity_gib * GIB - static
        rows = int(room // per_row) if room > 0 else 0
        max_batch = rows - rows % MULTIPLE if rows >= MULTIPLE else rows
    seconds = None
    rate = _flop_rate(gpu_name, setup)
    if rate and train_rows:
        samples_per_second = setup.processes * rate / shape.flops_per_sample(setup.source_len, setup.target_len)
        seconds = train_rows / samples_per_second
    return Estimate(
        peak_gib=(static + batch * per_row) / GIB,
        max_batch=max_batch,
        seconds_per_epoch=seconds,
        static_gib=static / GIB,
        per_row_gib=per_row / GIB,
        capacity_gib=capacity_gib,
    )


def _flop_rate(gpu_name: str | None, setup: Setup) -> float | None:
    if not gpu_name:
        return None
    for (gpu, family), rate in MEASURED_FLOPS.items():
        if gpu in gpu_name and family == setup.family:
            return rate
    return None


def pick_batch(shape: ModelShape, setup: Setup, capacity_gib: float | None) -> int:
    """The largest micro-batch that fits (a multiple of MULTIPLE where one fits); CPU_BATCH
    without a GPU. Raises BatchTooLarge when not even one row fits."""
    if not capacity_gib:
        return CPU_BATCH
    best = estimate(shape, 1, setup, capacity_gib).max_batch
    if best < 1:
        est = estimate(shape, 1, setup, capacity_gib)
        raise BatchTooLarge(
            f"not even one row fits: ≈ {est.peak_gib:.1f} GiB per GPU of {capacity_gib:.0f} for one row "
            f"({est.static_gib:.1f} GiB of weights and optimizer state); use ZeRO-3 + offload "
            "(configs/accelerate/zero3_offload.yaml), more GPUs, or shorter --max_source_length/--max_target_length"
        )
    return best


def check_fits(shape: ModelShape, batch: int, setup: Setup, capacity_gib: float) -> Estimate:
    """The estimate at ``batch``; BatchTooLarge naming the batch that fits when it does not."""
    est = estimate(shape, batch, setup, capacity_gib)
    if est.peak_gib > FIT_FRACTION * capacity_gib:
        fits = pick_batch(shape, setup, capacity_gib)
        raise BatchTooLarge(
            f"--per_device_train_batch_size {batch} needs ≈ {est.peak_gib:.0f} GiB per GPU, more than "
            f"{FIT_FRACTION:.0%} of the GPU's {capacity_gib:.0f} GiB; {fits} fits (or 'auto' picks it; "
            "--gradient_accumulation_steps keeps the effective batch)"
        )
    return est


def preflight_line(est: Estimate) -> str:
    """One line for the Train tab: '≈ 61 GiB peak per GPU of 140; ≈ 38 s per epoch'."""
    text = f"≈ {est.peak_gib:.0f} GiB peak per GPU" if est.peak_gib >= 10 else f"≈ {est.peak_gib:.1f} GiB peak per GPU"
    if est.capacity_gib:
        text += f" of {est.capacity_gib:.0f}"
    if est.seconds_per_epoch is not None:
        text += f"; ≈ {_duration(est.seconds_per_epoch)} per epoch"
    return text


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{math.ceil(seconds)} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def strategy_of(accelerate_config: str, processes: int = 1) -> str:
    """The memory model's strategy for one of configs/accelerate/*.yaml (by its file name)."""
    name = accelerate_config.rsplit("/", 1)[-1]
    if "zero3" in name:
        return "zero3_offload"
    if "zero2" in name:
        return "zero2"
    return "ddp" if processes > 1 else "single"


def lora_setup(cfg) -> dict:
    """Setup's LoRA fields for a TrainConfig (none for full fine-tuning)."""
    if cfg.adapter != "lora":
        return {}
    # (on a GPU the fused layers recompute the dropout instead of keeping its copies: finetune/lora_layer.py)
    dropout = 0.0 if cfg.lora_fused else cfg.lora_dropout
    return {"lora_r": cfg.lora_r, "lora_targets": tuple(cfg.lora_target_modules), "lora_dropout": dropout}


def gpu() -> tuple[str, float] | None:
    """(name, total GiB) of this process's GPU; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.total_memory / GIB


def resolve_batch(cfg, accelerator, model) -> int:
    """``cfg.per_device_train_batch_size`` as a number: 'auto' becomes the largest batch that fits
    this GPU (CPU_BATCH on a CPU); a number is kept, with a warning when the model says it will
    not fit (the estimate can be off by a few percent, so the run is still tried)."""
    ds = accelerator.state.deepspeed_plugin
    if ds is not None:
        zero = ds.deepspeed_config.get("zero_optimization", {})
        strategy = "zero3_offload" if zero.get("stage") == 3 else "zero2"
    else:
        strategy = "ddp" if accelerator.num_processes > 1 else "single"
    mixed = accelerator.mixed_precision
    setup = Setup(
        strategy=strategy,
        precision=mixed if mixed in ("bf16", "fp16") else "no",
        processes=accelerator.num_processes,
        source_len=cfg.max_source_length,
        target_len=cfg.max_target_length,
        attention="eager" if cfg.attention == "eager" else "sdpa",
        **lora_setup(cfg),
    )
    # (the base's weights: a LoRA model counts its adapter from the setup)
    params = sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if "lora_" not in n)
    shape = ModelShape.from_config(model.config, params=params)
    device = gpu()
    capacity = device[1] if device else None
    wanted = cfg.per_device_train_batch_size
    if wanted != "auto":
        if capacity:
            try:
                check_fits(shape, wanted, setup, capacity)
            except BatchTooLarge as err:
                log.warning("%s; trying it anyway", err)
        return wanted
    batch = pick_batch(shape, setup, capacity)
    if capacity:
        est = estimate(shape, batch, setup, capacity)
        log.info(
            "--per_device_train_batch_size auto: %d (%s, %s; %s)",
            batch,
            setup.strategy,
            setup.precision,
            preflight_line(est),
        )
    else:
        log.info("--per_device_train_batch_size auto: %d (no GPU)", batch)
    return batch
