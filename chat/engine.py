"""The chat engine: load a checkpoint, build input in its training format, generate replies.

One ``ChatEngine`` serves every session. It serves one base model and the LoRA adapters loaded on
it (``chat.serving``), each a model with a public id; ``current`` is the one new conversations
start with (what a trainer loaded last). A conversation carries the id of the model it started
with (``Conversation.model``), so loading another adapter does not change old conversations, and
each request takes a reference to its model when it starts, so a swap never disturbs a reply in
flight. Conversations are plain values passed in by the caller (the UI keeps one per browser
session), so sessions cannot see each other's history.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from chat.batching import STREAM_INTERVAL, Batcher, ReaderTextStreamer
from chat.layout import DEFAULT_MODEL, DEMO_DIR
from chat.loading import (  # loading lives there; BASE_PREFIX, load_checkpoint, place stay importable from here
    BASE_PREFIX,  # noqa: F401
    CheckpointError,
    LoadedModel,
    apart,
    load_apart,
    load_checkpoint,  # noqa: F401
    model_id,
    place,  # noqa: F401
)
from chat.model import ModelLoadError
from chat.prompt import CONTROL_RE, KINDS, fit_source, format_context, neutralize
from chat.serving import (
    AdapterError,
    Models,
    adapter_dir,
    adapter_model,
    base_matches,
    canonical,
    load_base,
    named_base,
)
from chat.stepping import make_batcher

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000  # server-side limits on user text
MAX_CONTEXT_CHARS = 600
# A conversation longer than this is refused: the model sees only its newest turns (128 tokens),
# and the cap bounds the work one request can cause, whatever a client sends.
MAX_HISTORY_TURNS = 1000


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
    model: str | None = None  # the id of the model it started with (None: the one serving now)


@dataclass(frozen=True)
class Budget:
    """How the encoder's positions are used by the last built input (for the UI's meter)."""

    context_tokens: int
    history_tokens: int
    total_tokens: int
    max_tokens: int
    dropped_turns: int


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


def clean_text(text: str | None, limit: int, what: str) -> str:
    """Strip control characters and outer space; refuse over-long text with a clear message."""
    text = CONTROL_RE.sub(" ", text or "").strip()
    if len(text) > limit:
        raise InputError(f"The {what} is too long ({len(text)} characters; the limit is {limit}).")
    return text


class NotOnBase(CheckpointError):
    """A model that would need another base model than the one the engine serves."""


class ChatEngine:
    def __init__(self, loaded: LoadedModel, status: str, batcher: Batcher | None = None):
        self._models = Models(loaded)  # the base and its adapters, by public id
        self._current = loaded
        self.status = status
        self.fallback: str | None = None  # why start() serves the demo model instead (one line), if it does
        self._swap = threading.Lock()  # current, status and the base change together
        # Every generate() goes through the batcher's worker thread, which also serialises
        # CPU work so concurrent sessions don't fight over the cores.
        self._batcher = batcher or make_batcher()
        self.stream_interval: float | None = None  # s between a stream's texts; None: STREAM_INTERVAL

    @classmethod
    def start(cls, spec: str | None = None) -> ChatEngine:
        """Serve ``spec`` (default: CHAT_MODEL or the 400M base model); offline, the demo model.
        ``fallback`` then says why, in one line for the server's log (the app logs it)."""
        spec = spec or os.environ.get("CHAT_MODEL", DEFAULT_MODEL)
        try:
            engine = cls.serving(spec)
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

    @classmethod
    def serving(cls, spec: str, optimize: str | None = None, batcher: Batcher | None = None) -> ChatEngine:
        """An engine serving ``spec``: a model, or an adapter on its base (both loaded)."""
        folder = adapter_dir(spec)
        if folder is None:
            return cls(load_apart(spec, optimize), f"serving {spec}", batcher)
        name, fingerprint = named_base(folder)
        engine = cls(load_base(folder, name, fingerprint, optimize), f"serving {name}", batcher)
        engine.swap(spec)
        return engine

    @property
    def current(self) -> LoadedModel:
        """The model new conversations start with."""
        return self._current

    @property
    def base(self) -> LoadedModel:
        """The base model served now (the adapters' host)."""
        return self._models.base

    def model_ids(self) -> list[str]:
        """The ids of the models this engine can serve now: the base, then the adapters on it
        (an adapter unloaded to save memory is attached again when a conversation asks for it)."""
        return self._models.ids()

    def swap(self, spec: str) -> str:
        """Serve ``spec`` to new conversations from now on; older ones keep their model. An adapter
        whose base serves is attached to it (the base is not loaded again); any other model, or an
        adapter of another base, replaces the base. On any failure the current model keeps serving."""
        folder = adapter_dir(spec)
        if folder is None:
            loaded = load_apart(spec)  # raises before anything changes
            self.warm_up(loaded)  # on a GPU, while the current model keeps serving
            with self._swap:
                self._models.set_base(loaded)
                self._current = loaded
                self.status = f"serving {spec}"
            return self.status
        try:
            loaded = self.load(spec)
        except NotOnBase:
            name, fingerprint = named_base(folder)
            base = load_base(folder, name, fingerprint, None)
            self.warm_up(base)
            loaded = apart(adapter_model, base, folder, self._models.claim(spec, str(folder)), name)
            self.warm_up(loaded)
            with self._swap:
                self._models.set_base(base)
                self._models.add(loaded)
        with self._swap:
            self._current = loaded
            self.status = f"serving {loaded.id} (LoRA on {self._models.base.id})"
        self._models.evict(keep=loaded)
        return self.status

    def serves_on_base(self, spec: str) -> bool:
        """Is ``spec`` the base served now or an adapter of it (servable without loading a base)?"""
        try:
            self._on_base(spec)
        except (NotOnBase, AdapterError):
            return False
        return True

    def _on_base(self, spec: str):
        """(adapter folder or None, the base it names or None), if ``spec`` serves on the base
        served now; else NotOnBase."""
        base = self._models.base
        folder = adapter_dir(spec)
        if folder is None:
            if canonical(spec) == canonical(base.name):
                return None, None
            raise NotOnBase(f"{model_id(spec)} is not {base.id} or an adapter of it")
        name, fingerprint = named_base(folder)
        if not base_matches(base, name, fingerprint):
            raise NotOnBase(f"{model_id(spec)} is an adapter of {model_id(name)}, not of {base.id}")
        return folder, name

    def load(self, spec: str) -> LoadedModel:
        """Make ``spec`` servable on the base served now, without changing what new conversations
        start with: the base itself, or an adapter of it (attached now unless it is attached and
        unchanged on disk). NotOnBase if it needs another base; AdapterError if it does not fit."""
        base = self._models.base
        folder, name = self._on_base(spec)
        if folder is None:
            return base
        known = self._models.by_folder(folder)
        if known is not None and self._models.attached(known) and not base.host.changed(known.adapter):
            return known
        loaded = apart(adapter_model, base, folder, self._models.claim(spec, str(folder)), name)
        self.warm_up(loaded)
        self._models.add(loaded)
        self._models.evict(keep=self._current)
        return loaded

    def model_for(self, model_id: str | None) -> LoadedModel:
        """The model a conversation started with (``Conversation.model``; None: the current one).
        An adapter unloaded to save memory is attached again; a model no longer served is refused
        with a note saying what serves now."""
        if not model_id:
            return self._current
        loaded = self._models.get(model_id)
        if loaded is not None:
            if not self._models.attached(loaded):
                apart(loaded.host.attach, loaded.folder, loaded.adapter, loaded.id, self._models.base.id)
                self._models.evict(keep=self._current)
            if loaded.host is not None:
                loaded.host.touch(loaded.adapter)  # most recently used: not the next one unloaded
            return loaded
        if self._models.known(model_id):
            raise InputError(
                f"This chat was with {model_id}, which is no longer loaded (the app now serves "
                f"{self._current.id}). Start a new chat to talk to {self._current.id}."
            )
        raise InputError(f"Unknown model {model_id!r}; models served now: {', '.join(self.model_ids())}.")

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

        counted: dict[str, list[int]] = {}  # source -> its ids: the one that fits is not encoded twice

        def count(source: str) -> int:
            counted[source] = loaded.encode(loaded.prefix + source)
            return len(counted[source])

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
        ids = counted.get(source) or loaded.encode(loaded.prefix + source)
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
        loaded = self.model_for(conv.model)  # this reply finishes on it, whatever is swapped in meanwhile
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
        return self.open_stream(conv, message, settings)[1]

    def open_stream(
        self, conv: Conversation, message: str, settings: GenerationSettings = GENERATION_PRESETS["fast"]
    ) -> tuple[LoadedModel, Iterator[tuple[str, Budget]]]:
        """``stream``, with the model that answers: the conversation's (``conv.model``), or for a
        new conversation the one serving when the call is made (name it in the next turn's
        ``Conversation.model`` to keep the conversation on it)."""
        prepared = self._prepare(conv, message, settings)
        return prepared[0], self._stream(settings, *prepared)

    def _stream(self, settings, loaded, encoded, budget, kwargs, outputs=None) -> Iterator[tuple[str, Budget]]:
        """``stream``'s generator; the generated ids are appended to ``outputs`` at the end."""
        if not settings.streams:
            out = self._generate(loaded, encoded, kwargs)
            if outputs is not None:
                outputs.append(out)
            yield self._clean_reply(loaded.tokenizer.decode(out[0], skip_special_tokens=True)), budget
            return
        every = self.stream_interval
        every = STREAM_INTERVAL.get(loaded.model.device.type, 0.0) if every is None else every
        streamer = ReaderTextStreamer(loaded.tokenizer, every, skip_prompt=False, skip_special_tokens=True, timeout=300)
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
