"""The models of the Compare view: at most one extra base model next to the serving one.

Comparing two models side by side needs both in memory. ``CompareSlot`` holds the pair of models
a trainer chose. A model of the pair that serves on the serving engine's base (that base itself,
or a LoRA adapter of it: ``ChatEngine.load`` attaches it) costs no other model: two adapters of
one base, or an adapter and its base, are compared with one base in memory. The rest of the pair
(a full model, or adapters of another base) goes to one extra engine, on one extra base. So the
process holds two base models at most. Loading another extra base frees the old one first (a
reply still being written on it keeps its own reference and finishes), and an extra engine nobody
used for ``IDLE_SECONDS`` is freed by a background thread; the next reply that needs it loads it
again.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from chat.engine import ChatEngine, load_apart
from chat.loading import model_id
from chat.serving import adapter_dir, canonical, named_base

log = logging.getLogger(__name__)

# An extra model unused this long is unloaded (its memory freed); the reaper looks this often.
IDLE_SECONDS = 10 * 60
REAP_INTERVAL_S = 60.0


class CompareError(RuntimeError):
    """The comparison cannot run as asked; the message is meant for the user."""


def base_key(spec: str) -> str:
    """The base ``spec`` serves on, spelled one way: an adapter's base, or the model itself."""
    folder = adapter_dir(spec)
    return canonical(named_base(folder)[0] if folder is not None else spec)


def short(spec: str) -> str:
    """A spec as a public id (no server path), for messages."""
    return model_id(spec)


def same_model(a: str | None, b: str | None) -> bool:
    """Do two specs name the same model (equal, or the same local folder)?"""
    if not a or not b:
        return False
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


class CompareSlot:
    """The chosen pair (A, B) and the one extra engine it may need; thread-safe.

    ``serving`` is the app's serving engine: a model of the pair that serves on its base is never
    loaded a second time. ``loader`` (``load_apart``'s signature, for a base) and ``clock`` are
    for tests."""

    def __init__(
        self,
        serving: ChatEngine,
        optimize: str | None = None,
        idle_seconds: float = IDLE_SECONDS,
        loader: Callable = load_apart,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.serving = serving
        self.optimize, self.idle_seconds = optimize, idle_seconds
        self._loader, self._clock = loader, clock
        self._engine: ChatEngine | None = None
        self._spec: str | None = None
        self._pair: tuple[str, str] | None = None
        self._lock = threading.Lock()  # the fields above and last_used
        self._loading = threading.Lock()  # one load at a time (each frees the previous model first)
        self.last_used = clock()

    # --- state
    @property
    def pair(self) -> tuple[str, str] | None:
        """The models chosen as (A, B), or None before a trainer chose them."""
        with self._lock:
            return self._pair

    @property
    def loaded_spec(self) -> str | None:
        """The model the extra engine was loaded for (None: only the serving base is loaded)."""
        with self._lock:
            return self._spec

    @property
    def extra(self) -> ChatEngine | None:
        with self._lock:
            return self._engine

    def is_serving(self, spec: str) -> bool:
        """Does ``spec`` serve on the serving base (itself, or an adapter of it)?"""
        return self.serving.serves_on_base(spec)

    def touch(self) -> None:
        with self._lock:
            self.last_used = self._clock()

    # --- loading
    def load(self, spec: str) -> ChatEngine:
        """The engine for ``spec``: the serving engine if it serves on its base (an adapter is
        attached), else the extra engine, loaded now if it is on another base (the previous extra
        engine is freed first)."""
        with self._loading:
            return self._engine_for(spec)[0]

    def _engine_for(self, spec: str) -> tuple[ChatEngine, str]:  # with self._loading held
        """(the engine serving ``spec``, its model id there)."""
        if self.is_serving(spec):
            self.touch()
            return self.serving, self.serving.load(spec).id
        with self._lock:
            engine = self._engine
        if engine is not None and engine.serves_on_base(spec):
            loaded = engine.load(spec)
            self.touch()
            return engine, loaded.id
        self._free()  # before loading: never three base models in memory
        engine = self._extra_engine(spec)
        engine.warm_up()  # on a GPU: compile its decoding now, not in a visitor's first reply
        with self._lock:
            self._engine, self._spec, self.last_used = engine, spec, self._clock()
        log.info("compare: loaded %s", spec)
        return engine, engine.current.id

    def _extra_engine(self, spec: str) -> ChatEngine:
        """An engine of its own for ``spec`` (a model, or an adapter on its base). The serving
        engine's batcher runs its generate() calls too, so the two share the CPU one call at a
        time instead of fighting over the cores."""
        folder = adapter_dir(spec)
        base_spec = named_base(folder)[0] if folder is not None else spec
        engine = ChatEngine(self._loader(base_spec, optimize=self.optimize), f"comparing {spec}", self.serving._batcher)
        if folder is not None:
            engine.swap(spec)  # checks the base it names, then attaches
        return engine

    def choose(self, a: str, b: str) -> tuple[str, str]:
        """Compare ``a`` with ``b`` from now on, loading what the serving base cannot serve.

        What the serving base does not serve must fit on one other base (a model and its adapters,
        or adapters of one base): the process holds two base models at most. On a failed load the
        previous pair stays chosen (its extra engine is loaded again when needed)."""
        if same_model(a, b):
            raise CompareError("Pick two different models to compare.")
        extras = [spec for spec in (a, b) if not self.is_serving(spec)]
        if len({base_key(spec) for spec in extras}) > 1:
            raise CompareError(
                "One of the two models must be the one being served, an adapter of it, or share a base with "
                "the other: the app holds two base models at most (the serving one and one more). To compare "
                "two others, serve one of them first (Chat tab, Model)."
            )
        with self._loading:  # a reply starting meanwhile sees the old pair or the new one, whole
            if not extras:
                self._free()  # both on the serving base: one base in memory
            for spec in (a, b):
                if spec in extras[1:] and not self._engine.serves_on_base(spec):
                    raise CompareError(f"{short(a)} and {short(b)} are not on one base: compare models that share one.")
                self._engine_for(spec)
            with self._lock:
                self._pair = (a, b)
        return a, b

    def engines(self) -> tuple[tuple[str, ChatEngine, str], tuple[str, ChatEngine, str]]:
        """((spec A, engine A, model id A), (spec B, ...)) for a reply: a conversation on engine A
        names model id A. The extra engine is loaded again if it was freed while idle. Waits while
        a load is under way."""
        with self._loading:
            pair = self.pair
            if pair is None:
                raise CompareError("No models to compare yet: a trainer chooses them below (Models, Load).")
            extras = [spec for spec in pair if not self.is_serving(spec)]
            if len({base_key(spec) for spec in extras}) > 1:
                raise CompareError(
                    "The served model changed since the models to compare were chosen; "
                    "a trainer needs to choose them again (Models, Load)."
                )
            return tuple((spec, *self._engine_for(spec)) for spec in pair)

    # --- freeing
    def _free(self) -> bool:
        with self._lock:
            engine, self._engine, self._spec = self._engine, None, None
        if engine is None:
            return False
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def unload(self) -> bool:
        """Free the extra model now (True if one was loaded). The chosen pair stays."""
        with self._loading:
            freed = self._free()
        if freed:
            log.info("compare: unloaded the extra model")
        return freed

    def unload_if_idle(self, idle_seconds: float | None = None) -> bool:
        """Free the extra model if nobody used it for ``idle_seconds`` (default: the slot's)."""
        idle = self.idle_seconds if idle_seconds is None else idle_seconds
        if not self._loading.acquire(blocking=False):
            return False  # a load is under way: the model is about to be used
        try:
            with self._lock:
                idle_for = self._clock() - self.last_used
                if self._engine is None or idle_for < idle:
                    return False
            freed = self._free()
        finally:
            self._loading.release()
        if freed:
            log.info("compare: unloaded the extra model after %.0f s unused", idle_for)
        return freed

    def start_reaper(self, interval: float = REAP_INTERVAL_S) -> threading.Thread:
        """A daemon thread that frees the extra model when idle; it ends with the slot."""
        ref = weakref.ref(self)  # the thread must not keep the slot (and its model) alive

        def reap() -> None:
            while True:
                time.sleep(interval)
                slot = ref()
                if slot is None:
                    return
                try:
                    slot.unload_if_idle()
                except Exception:  # noqa: BLE001 - keep reaping; a failure here must not end the thread
                    log.exception("compare: idle unload failed")
                del slot

        thread = threading.Thread(target=reap, daemon=True, name="compare-reaper")
        thread.start()
        return thread
