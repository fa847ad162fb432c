"""The chat engine: load a checkpoint, build input in its training format, generate replies.

One ``ChatEngine`` serves every session. It holds the current ``LoadedModel``; each request
takes a reference to it when it starts, so swapping in a new checkpoint never disturbs a reply
in flight. Conversations are plain values passed in by the caller (the UI keeps one per browser
session), so sessions cannot see each other's history.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, TextIteratorStreamer

from chat.batching import Batcher
from chat.layout import DEFAULT_MODEL, DEMO_DIR, FINAL, TRAINING_ARGS_FILE, is_hub_id, list_finals
from chat.model import ModelLoadError, hub_options, load_error, load_model, load_tokenizer, resolve
from chat.optimize import CPU_DEFAULT, OPTIMIZE_MODES, optimize_for_cpu
from chat.prompt import CONTROL_RE, KINDS, fit_source, format_context, neutralize

log = logging.getLogger(__name__)

# The seed fine-tuned with the prefix "chatbot: " and Chat-E spoke to its model with it. A
# checkpoint without training_args.json (the base model) gets this one; set CHAT_SOURCE_PREFIX
# to change it (e.g. to "" for the untouched base model).
BASE_PREFIX = "chatbot: "
MAX_MESSAGE_CHARS = 1000  # server-side limits on user text
MAX_CONTEXT_CHARS = 600
# A conversation longer than this is refused: the model sees only its newest turns (128 tokens),
# and the cap bounds the work one request can cause, whatever a client sends.
MAX_HISTORY_TURNS = 1000


class CheckpointError(RuntimeError):
    """A checkpoint cannot serve (missing files, non-finite weights, wrong architecture)."""


class InputError(ValueError):
    """User input the engine refuses; the message is meant for the user."""


@dataclass(frozen=True)
class GenerationSettings:
    """Every knob of a reply. Presets are instances; the UI overrides single fields."""

    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 40
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 3
    encoder_no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.2
    length_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not 1 <= self.num_beams <= 16:
            raise InputError("beams must be between 1 and 16")
        if not 1 <= self.max_new_tokens <= 128:
            raise InputError("max new tokens must be between 1 and 128")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InputError("min new tokens must be between 0 and max new tokens")
        if not 0.05 <= self.temperature <= 2.0 or not 0.05 <= self.top_p <= 1.0:
            raise InputError("temperature must be in [0.05, 2] and top-p in [0.05, 1]")
        if not 1.0 <= self.repetition_penalty <= 3.0 or not 0.1 <= self.length_penalty <= 3.0:
            raise InputError("repetition penalty must be in [1, 3] and length penalty in [0.1, 3]")
        if not 0 <= self.no_repeat_ngram_size <= 10 or not 0 <= self.encoder_no_repeat_ngram_size <= 10:
            raise InputError("n-gram blocking sizes must be between 0 (off) and 10")

    @property
    def streams(self) -> bool:
        """Beam search only knows its answer at the end; greedy and sampling can stream."""
        return self.num_beams == 1

    def generate_kwargs(self) -> dict:
        kwargs = dict(
            num_beams=self.num_beams,
            do_sample=self.do_sample,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            encoder_no_repeat_ngram_size=self.encoder_no_repeat_ngram_size,
            repetition_penalty=self.repetition_penalty,
            length_penalty=self.length_penalty,
        )
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p)
        return kwargs


GENERATION_PRESETS = {
    # The seed's evaluation / Chat-E settings: beam 10, min length 20, n-gram blocking.
    "faithful": GenerationSettings(
        num_beams=10,
        min_new_tokens=20,
        max_new_tokens=60,
        no_repeat_ngram_size=3,
        encoder_no_repeat_ngram_size=3,
        repetition_penalty=1.2,
    ),
    # Greedy with n-gram blocking: streams token by token, a fraction of beam-10's cost.
    "fast": GenerationSettings(num_beams=1, max_new_tokens=40, no_repeat_ngram_size=3, repetition_penalty=1.2),
}


@dataclass
class Conversation:
    """One chat: who the bot is (kind + context) and the turns so far, oldest first."""

    kind: str = "none"
    context: str = ""
    turns: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Budget:
    """How the encoder's positions are used by the last built input (for the UI's meter)."""

    context_tokens: int
    history_tokens: int
    total_tokens: int
    max_tokens: int
    dropped_turns: int


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    prefix: str
    max_source_length: int
    trained_args: dict | None

    def count(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)


@dataclass(frozen=True)
class Reply:
    """A reply as an API reports it (``ChatEngine.replies``): the text so far while it streams,
    then the whole reply with its generated token ids (``tokens``, None until then)."""

    text: str
    budget: Budget
    model: LoadedModel  # the model that wrote it
    tokens: tuple[int, ...] | None = None  # generated ids, up to and including the end token
    cut: bool = False  # ended by max_new_tokens, not by the model

    def text_of(self, n: int) -> str:
        """The reply as ``text`` shows it, from its first ``n`` tokens only."""
        decoded = self.model.tokenizer.decode(list(self.tokens[:n]), skip_special_tokens=True)
        return ChatEngine._clean_reply(decoded)


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
    args_file = local / TRAINING_ARGS_FILE if local else None
    trained = json.loads(args_file.read_text()) if args_file and args_file.is_file() else None
    prefix = trained["source_prefix"] if trained else os.environ.get("CHAT_SOURCE_PREFIX", BASE_PREFIX)
    max_len = min(trained["max_source_length"] if trained else 128, config.max_position_embeddings)
    return LoadedModel(spec, model, tokenizer, prefix, max_len, trained)


def load_apart(spec: str, optimize: str | None = None) -> LoadedModel:
    """``load_checkpoint`` in a thread of its own that ends with the load.

    On a CPU, each thread that runs torch operators gets its own OpenMP team, alive as long as the
    thread. A second team on the cores (the loader's next to the batcher's) makes GNU OpenMP stop
    spin-waiting, so every operator of every decoding step then waits for its threads to wake: on 2
    cores a 24-token int8 reply went from 0.67 to 0.97 s after a load in a thread that lives on (the
    main thread at start, a Gradio worker on a swap). A loader thread that exits takes its team along."""
    with ThreadPoolExecutor(1, thread_name_prefix="chat-load") as pool:
        return pool.submit(load_checkpoint, spec, optimize).result()


def clean_text(text: str | None, limit: int, what: str) -> str:
    """Strip control characters and outer space; refuse over-long text with a clear message."""
    text = CONTROL_RE.sub(" ", text or "").strip()
    if len(text) > limit:
        raise InputError(f"The {what} is too long ({len(text)} characters; the limit is {limit}).")
    return text


class ChatEngine:
    def __init__(self, loaded: LoadedModel, status: str, batcher: Batcher | None = None):
        self._current = loaded
        self.status = status
        self.fallback: str | None = None  # why start() serves the demo model instead (one line), if it does
        self._swap = threading.Lock()
        # Every generate() goes through the batcher's worker thread, which also serialises
        # CPU work so concurrent sessions don't fight over the cores.
        self._batcher = batcher or Batcher()

    @classmethod
    def start(cls, spec: str | None = None) -> ChatEngine:
        """Serve ``spec`` (default: CHAT_MODEL or the 400M base model); offline, the demo model.
        ``fallback`` then says why, in one line for the server's log (the app logs it)."""
        spec = spec or os.environ.get("CHAT_MODEL", DEFAULT_MODEL)
        try:
            engine = cls(load_apart(spec), f"serving {spec}")
        except ModelLoadError as err:
            engine = cls(
                load_apart(str(DEMO_DIR)),
                f"offline: using the demo model (a tiny BlenderBot trained on the sample data) instead of {spec}",
            )
            # The chat's own advice, not the training CLI's (--model_name_or_path is no setting of the app).
            engine.fallback = (
                f"{err.reason}; falling back to the demo model. To serve it, run once with network access "
                "so it is cached, or set CHAT_MODEL to a model folder (a run's final/) or a cached Hub id"
            )
        engine.warm_up()
        return engine

    @property
    def current(self) -> LoadedModel:
        return self._current

    def swap(self, spec: str) -> str:
        """Load ``spec`` and serve it from now on; on any failure the current model keeps serving."""
        loaded = load_apart(spec)  # raises before anything changes
        self.warm_up(loaded)  # on a GPU, while the current model keeps serving
        with self._swap:
            self._current = loaded
            self.status = f"serving {spec}"
        return self.status

    def warm_up(self, loaded: LoadedModel | None = None) -> None:
        """On a GPU, prepare the CUDA-graph decoding of ``loaded`` (default: the current model)
        before users wait for it. ``capture`` records the first shapes (milliseconds each; later
        shapes record on first use); ``compile`` compiles greedy decoding for two input lengths and
        a full batch, so every later shape is covered by the dynamic-shape graph (~20-40 s)."""
        loaded = loaded or self._current
        mode = self._batcher.cuda_graphs
        if loaded.model.device.type != "cuda" or mode == "off":
            return
        log.info("preparing GPU decoding for %s (CUDA graphs: %s)", loaded.name, mode)
        presets = ["fast", "faithful"] if mode == "capture" else ["fast"]
        messages = ["hello", "hello there, how has your day been so far? mine was long."]
        try:
            for name in presets:
                kwargs = GENERATION_PRESETS[name].generate_kwargs()
                for message in messages:
                    encoded, _ = self.build_input(Conversation(turns=[message]), loaded)
                    self._generate(loaded, encoded, kwargs)
            if mode == "compile":
                batch = [
                    self.build_input(Conversation(turns=[f"hello {'and ' * i}bye"]), loaded)[0]
                    for i in range(self._batcher.max_batch)
                ]
                for future in [self._batcher.submit(loaded, encoded, kwargs) for encoded in batch]:
                    future.result()
        except Exception as err:  # e.g. no compiler for Triton: serve as before, only slower
            log.warning("CUDA-graph decoding failed (%s: %s); serving without it", type(err).__name__, err)
            self._batcher.cuda_graphs = "off"

    # --- input
    def build_input(self, conv: Conversation, loaded: LoadedModel | None = None) -> tuple[dict, Budget]:
        loaded = loaded or self._current
        if conv.kind not in KINDS:
            raise InputError(f"Unknown kind {conv.kind!r}; choose one of {', '.join(KINDS)}.")
        context = clean_text(conv.context, MAX_CONTEXT_CHARS, "context")
        try:
            context_text = format_context(conv.kind, context)
        except ValueError:
            raise InputError(f"The {conv.kind} needs a context (e.g. a persona sentence).") from None
        if len(conv.turns) > MAX_HISTORY_TURNS:
            raise InputError(
                f"The conversation is too long ({len(conv.turns)} turns; the limit is "
                f"{MAX_HISTORY_TURNS}). Start a new chat: the model only sees the last few turns."
            )
        turns = [neutralize(clean_text(t, MAX_MESSAGE_CHARS, "message")) for t in conv.turns]
        if not turns or not turns[-1]:
            raise InputError("Type a message first.")
        # Turns alternate between the user and the bot with no speaker marks: dropping an empty
        # one (a reply that came out blank) would swap who said every older turn. Keep its place.
        turns = [t or "..." for t in turns]

        def count(source: str) -> int:
            return loaded.count(loaded.prefix + source)

        # The context must leave room for the conversation, or the newest message would not fit.
        context_tokens = count(context_text) if context_text else loaded.count(loaded.prefix)
        if context_tokens > loaded.max_source_length // 2:
            raise InputError(
                f"The context is too long: it takes {context_tokens} of the model's "
                f"{loaded.max_source_length} tokens; keep it under {loaded.max_source_length // 2}."
            )
        source, dropped = fit_source(context_text, turns, count, loaded.max_source_length)
        # No truncation=True here: it is mutable state of the shared Rust tokenizer, and a
        # concurrent session's count() would see it. Cut by hand, keeping the final </s>.
        ids = loaded.tokenizer(loaded.prefix + source).input_ids
        if len(ids) > loaded.max_source_length:
            ids = ids[: loaded.max_source_length - 1] + ids[-1:]
        input_ids = torch.tensor([ids])
        encoded = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        total = len(ids)
        context_tokens = min(total, context_tokens)
        return encoded, Budget(context_tokens, total - context_tokens, total, loaded.max_source_length, dropped)

    # --- output
    @staticmethod
    def _clean_reply(text: str) -> str:
        text = CONTROL_RE.sub(" ", text).replace("\ufffd", "")  # stray bytes of an untrained model
        return re.sub(r"\s+", " ", text).strip()

    def _prepare(self, conv: Conversation, message: str, settings: GenerationSettings):
        message = clean_text(message, MAX_MESSAGE_CHARS, "message")
        if not neutralize(message):
            raise InputError("Type a message first.")
        loaded = self._current  # this reply finishes on this model, whatever is swapped in meanwhile
        asked = replace(conv, turns=[*conv.turns, message])
        encoded, budget = self.build_input(asked, loaded)
        kwargs = settings.generate_kwargs()
        if settings.seed is not None:
            kwargs["generator_seed"] = settings.seed  # the batcher seeds torch and runs it alone
        return loaded, encoded, budget, kwargs

    def _generate(self, loaded: LoadedModel, encoded, kwargs: dict, streamer=None) -> torch.Tensor:
        return self._batcher.submit(loaded, encoded, kwargs, streamer).result()

    def reply(
        self, conv: Conversation, message: str, settings: GenerationSettings = GENERATION_PRESETS["fast"]
    ) -> tuple[str, Budget]:
        """The bot's answer to ``message`` given ``conv``; ``conv`` is not modified."""
        loaded, encoded, budget, kwargs = self._prepare(conv, message, settings)
        out = self._generate(loaded, encoded, kwargs)
        return self._clean_reply(loaded.tokenizer.decode(out[0], skip_special_tokens=True)), budget

    def stream(
        self, conv: Conversation, message: str, settings: GenerationSettings = GENERATION_PRESETS["fast"]
    ) -> Iterator[tuple[str, Budget]]:
        """Yield the reply so far as it is generated (once, at the end, for beam search).

        Bad input raises InputError here, at the call, not at the first ``next()``."""
        prepared = self._prepare(conv, message, settings)
        return self._stream(settings, *prepared)

    def _stream(self, settings, loaded, encoded, budget, kwargs, outputs=None) -> Iterator[tuple[str, Budget]]:
        """``stream``'s generator; the generated ids are appended to ``outputs`` at the end."""
        if not settings.streams:
            out = self._generate(loaded, encoded, kwargs)
            if outputs is not None:
                outputs.append(out)
            yield self._clean_reply(loaded.tokenizer.decode(out[0], skip_special_tokens=True)), budget
            return
        streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=False, skip_special_tokens=True, timeout=300)
        future = self._batcher.submit(loaded, encoded, kwargs, streamer)
        text = ""
        for piece in streamer:
            text += piece
            if text.strip():
                yield self._clean_reply(text), budget
        out = future.result()  # re-raises a generation error in the caller's thread
        if outputs is not None:
            outputs.append(out)
        if not text.strip():
            yield "", budget

    def replies(
        self, conv: Conversation, message: str, settings: GenerationSettings = GENERATION_PRESETS["fast"]
    ) -> Iterator[Reply]:
        """``stream`` with what an API reports (the OpenAI-compatible routes, api/): the reply so
        far as it grows, then the whole ``Reply`` with its token ids and why it ended. Bad input
        raises InputError here, at the call."""
        loaded, encoded, budget, kwargs = self._prepare(conv, message, settings)

        def replies() -> Iterator[Reply]:
            outputs, text = [], ""
            for text, _ in self._stream(settings, loaded, encoded, budget, kwargs, outputs):
                yield Reply(text, budget, loaded)
            ids = outputs[0][0, 1:].tolist()  # without the decoder's start token
            eos, pad = loaded.tokenizer.eos_token_id, loaded.tokenizer.pad_token_id
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids  # a batch pads rows that ended early
            while eos not in ids and ids and ids[-1] == pad:
                ids.pop()
            yield Reply(text, budget, loaded, tuple(ids), cut=len(ids) >= settings.max_new_tokens)

        return replies()

    def respond(
        self, conv: Conversation, message: str, settings: GenerationSettings = GENERATION_PRESETS["fast"]
    ) -> str:
        """Library convenience: reply and append the exchange to ``conv``."""
        text, _ = self.reply(conv, message, settings)
        conv.turns += [clean_text(message, MAX_MESSAGE_CHARS, "message"), text]
        return text
