"""Loading a model to serve: checks, placement (CPU optimizations or the GPU), input format.

``load_checkpoint`` loads a base or fully fine-tuned model from a Hub id, a preset, a checkpoint
folder or a training output folder, checks it and returns a ``LoadedModel``: the model with its
tokenizer and the input format it was trained with (training_args.json). An adapter is served on
such a model (``chat.serving``): its ``LoadedModel`` shares the base's model object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, GenerationConfig

from chat.adapters import model_fingerprint
from chat.layout import DEMO_DIR, FINAL, TRAINING_ARGS_FILE, is_hub_id, list_finals
from chat.model import (
    MODEL_PRESETS,
    ModelLoadError,
    hub_options,
    load_error,
    load_model,
    load_tokenizer,
    preset_dir,
    resolve,
)
from chat.optimize import CPU_DEFAULT, OPTIMIZE_MODES, optimize_for_cpu

T = TypeVar("T")

# The seed fine-tuned with the prefix "chatbot: " and Chat-E spoke to its model with it. A
# checkpoint without training_args.json (the base model) gets this one; set CHAT_SOURCE_PREFIX
# to change it (e.g. to "" for the untouched base model).
BASE_PREFIX = "chatbot: "


class CheckpointError(RuntimeError):
    """A checkpoint cannot serve (missing files, non-finite weights, wrong architecture)."""


@dataclass
class LoadedModel:
    """A model the chat serves: the weights, the tokenizer and the input format it was trained with.

    An adapter (``chat.serving``) is a LoadedModel of its own whose ``model`` is its base's model
    object, with ``adapter`` naming the peft adapter on it and ``host`` the ``chat.serving.Host``
    that switches adapters; a base that adapters share has the same ``host``."""

    name: str  # the spec it was loaded from (may be a server path: shown to visitors as ``id``)
    model: torch.nn.Module
    tokenizer: object
    prefix: str
    max_source_length: int
    trained_args: dict | None
    fingerprint: str | None = None  # of the base (chat.adapters.model_fingerprint, before casting)
    id: str = ""  # the public model id (``model_id``): what a conversation and the API name it by
    adapter: str | None = None  # the peft adapter on ``model`` that answers; None: the model alone
    folder: Path | None = None  # an adapter's folder (attached again after an unload)
    host: object = None  # chat.serving.Host, once adapters share ``model``

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def activated(self):
        """The context in which ``model`` answers as this model: the batcher's worker runs each
        generate() in it (the host switches to this adapter, or to none, under its lock)."""
        return self.host.serving(self) if self.host is not None else nullcontext()


def model_id(spec: str) -> str:
    """A model's public id, never a server path: a Hub id or preset as given; a local folder by
    name: "demo-model" for the bundled one, a preset's name for its folder, ``RUN`` for a run's
    folder or its ``RUN/final/``, else the folder's own name. (The engine makes ids unique among
    the models it served.)"""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return spec
    path = path.resolve()
    if path == DEMO_DIR:
        return "demo-model"
    presets = [name for name in MODEL_PRESETS if preset_dir(name).resolve() == path]
    if presets:
        return presets[0]
    if (path / FINAL).is_dir():
        path = path / FINAL
    return path.parent.name if path.name == FINAL else path.name


def training_args(folder: Path) -> dict | None:
    """A model folder's training_args.json (how it was trained), or None if it has none."""
    file = folder / TRAINING_ARGS_FILE
    if not file.is_file():
        return None
    try:
        args = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{model_id(str(folder))}: unreadable {TRAINING_ARGS_FILE} ({err})") from None
    if not isinstance(args, dict):
        raise CheckpointError(f"{model_id(str(folder))}: {TRAINING_ARGS_FILE} is not a JSON object")
    return args


def input_format(trained: dict | None, max_positions: int) -> tuple[str, int]:
    """(source prefix, max source tokens) for a model trained with ``trained`` (training_args.json),
    so the chat formats input as it was trained; without one, the base model's."""
    prefix = trained.get("source_prefix") if trained else None
    if not isinstance(prefix, str):
        prefix = os.environ.get("CHAT_SOURCE_PREFIX", BASE_PREFIX)
    length = trained.get("max_source_length") if trained else None
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        length = 128
    return prefix, min(length, max_positions)


def _resolve_dir(spec: str) -> Path | None:
    """A local model directory for ``spec``: itself, its final/, or the newest RUN/final/."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        if path.exists() or not is_hub_id(spec) or spec.startswith((".", "~")):
            # "./runs/x", "/abs/path", "runs/a/final": a path that is not there, not a Hub id
            raise CheckpointError(f"{spec}: no such model folder")
        return None
    if (path / "config.json").is_file():
        return path
    if (path / FINAL / "config.json").is_file():
        return path / FINAL
    finals = list_finals(path)
    if finals:
        return finals[0]
    raise CheckpointError(f"{spec}: no model here (expected config.json, {FINAL}/, or RUN/{FINAL}/)")


def place(model: torch.nn.Module, optimize: str | None) -> torch.nn.Module:
    """Put a loaded model where and how it serves fastest (see docs/chat-benchmarks.md).

    ``optimize``: "none" (fp32 as trained), "bf16", "int8" (CPU: dynamic int8 linear layers),
    or "auto"/None: CHAT_OPTIMIZE if set, else fp32 on a GPU and the CPU default below. (One
    reply on a GPU is bound by per-token overhead, not arithmetic: on an H200 fp32 answered in
    0.18 s where bf16 took 0.27 s, and served 8 concurrent chats 1.9x faster.)
    """
    mode = optimize or "auto"
    if mode == "auto":
        mode = os.environ.get("CHAT_OPTIMIZE", "none" if torch.cuda.is_available() else CPU_DEFAULT)
    if mode not in OPTIMIZE_MODES:
        raise ValueError(f"optimize must be one of {', '.join(OPTIMIZE_MODES)}, got {mode!r}")
    if torch.cuda.is_available():
        return model.to("cuda", dtype=torch.bfloat16 if mode in ("bf16", "int8") else torch.float32)
    return optimize_for_cpu(model, mode)


def load_checkpoint(spec: str, optimize: str | None = None) -> LoadedModel:
    """Load and check a model from a Hub id, a checkpoint folder, or a training output folder."""
    local = _resolve_dir(resolve(spec))  # presets ("tiny", "random-400M") become directories
    source = str(local) if local else spec
    if local:
        missing = [f for f in ("config.json", "model.safetensors") if not (local / f).is_file()]
        if not (local / "tokenizer.json").is_file() and not (local / "vocab.json").is_file():
            missing.append("tokenizer.json")
        if missing and not (local / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"{local}: missing {', '.join(missing)}")
    try:
        config = AutoConfig.from_pretrained(source, **hub_options(source))
    except (OSError, ValueError) as err:
        if local:
            raise CheckpointError(
                f"{spec}: unreadable config.json ({str(err).splitlines()[0] if str(err) else err})"
            ) from None
        raise load_error(spec, err) from None
    if config.model_type != "blenderbot" or not config.is_encoder_decoder:
        raise CheckpointError(f"{spec}: a {config.model_type!r} model, not a seq2seq BlenderBot")
    try:
        model, info = load_model(source, output_loading_info=True)
    except ModelLoadError:
        if local:
            raise CheckpointError(f"{spec}: the weights do not load") from None
        raise
    except Exception as err:  # truncated file, shapes that don't match the config, ...
        raise CheckpointError(f"{spec}: the weights do not load ({type(err).__name__}: {str(err)[:200]})") from None
    broken = sorted(map(str, [*info["missing_keys"], *info["mismatched_keys"]]))
    if broken:  # transformers would initialise these at random: a broken model serving noise
        raise CheckpointError(f"{spec}: weights missing or mismatched: {', '.join(broken[:3])}")
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise CheckpointError(f"{spec}: non-finite weights in {', '.join(bad[:3])}")
    model.eval()
    fingerprint = model_fingerprint(model)  # before casting or quantizing: how adapters recognise it
    # Keep only the token ids of the saved generation config: a training run saves its evaluation
    # lengths there, which would clash with the chat's own settings (GenerationSettings).
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        decoder_start_token_id=saved.decoder_start_token_id,
        bos_token_id=saved.bos_token_id,
        eos_token_id=saved.eos_token_id,
        pad_token_id=saved.pad_token_id,
        forced_eos_token_id=saved.forced_eos_token_id,
    )
    model = place(model, optimize)
    tokenizer = load_tokenizer(source)
    trained = training_args(local) if local else None
    prefix, max_len = input_format(trained, config.max_position_embeddings)
    return LoadedModel(spec, model, tokenizer, prefix, max_len, trained, fingerprint, model_id(spec))


def apart(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` in a thread of its own that ends with it (loading, attaching an adapter).

    On a CPU, each thread that runs torch operators gets its own OpenMP team, alive as long as the
    thread. A second team on the cores (the loader's next to the batcher's) makes GNU OpenMP stop
    spin-waiting, so every operator of every decoding step then waits for its threads to wake: on 2
    cores a 24-token int8 reply went from 0.67 to 0.97 s after a load in a thread that lives on (the
    main thread at start, a Gradio worker on a swap). A loader thread that exits takes its team along."""
    with ThreadPoolExecutor(1, thread_name_prefix="chat-load") as pool:
        return pool.submit(fn, *args).result()


def load_apart(spec: str, optimize: str | None = None) -> LoadedModel:
    """``load_checkpoint`` in a thread that ends with the load (``apart`` says why)."""
    return apart(load_checkpoint, spec, optimize)
