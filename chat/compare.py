"""The second model of the Compare view: at most one extra model next to the serving one.

Comparing two models side by side needs both in memory. ``CompareSlot`` holds the pair of
models a trainer chose and, of those, the one that is not the serving model (a ``ChatEngine``
of its own). So the process holds two models at most: the serving one and this one. Loading
another extra model frees the old one first (a reply still being written on it keeps its own
reference and finishes), and an extra model nobody used for ``IDLE_SECONDS`` is freed by a
background thread; the next reply that needs it loads it again.
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

log = logging.getLogger(__name__)

# An extra model unused this long is unloaded (its memory freed); the reaper looks this often.
IDLE_SECONDS = 10 * 60
REAP_INTERVAL_S = 60.0


class CompareError(RuntimeError):
    """The comparison cannot run as asked; the message is meant for the user."""


def same_model(a: str | None, b: str | None) -> bool:
    """Do two specs name the same model (equal, or the same local folder)?"""
    if not a or not b:
        return False
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


class CompareSlot:
    """The chosen pair (A, B) and the one extra model it needs; thread-safe.

    ``serving`` is the app's serving engine: a model of the pair that it serves is never loaded
    a second time. ``loader`` and ``clock`` are for tests."""

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
        """The extra model in memory now (None: only the serving model is loaded)."""
        with self._lock:
            return self._spec

    @property
    def extra(self) -> ChatEngine | None:
        with self._lock:
            return self._engine

    def is_serving(self, spec: str) -> bool:
        return same_model(spec, self.serving.current.name)

    def touch(self) -> None:
        with self._lock:
            self.last_used = self._clock()

    # --- loading
    def load(self, spec: str) -> ChatEngine:
        """The engine for ``spec``: the serving engine if it serves ``spec``, else the extra
        model, loaded now if it is another one (the previous extra model is freed first)."""
        with self._loading:
            return self._engine_for(spec)

    def _engine_for(self, spec: str) -> ChatEngine:  # with self._loading held
        if self.is_serving(spec):
            self.touch()
            return self.serving
        with self._lock:
            if self._engine is not None and same_model(spec, self._spec):
                self.last_used = self._clock()
                return self._engine
        self._free()  # before loading: never three models in memory
        loaded = self._loader(spec, optimize=self.optimize)
        # The serving engine's batcher runs both models' generate() calls, so the two share the
        # CPU one call at a time instead of fighting over the cores.
        engine = ChatEngine(loaded, f"comparing {spec}", batcher=self.serving._batcher)
        engine.warm_up()  # on a GPU: compile its decoding now, not in a visitor's first reply
        with self._lock:
            self._engine, self._spec, self.last_used = engine, spec, self._clock()
        log.info("compare: loaded %s", spec)
        return engine

    def choose(self, a: str, b: str) -> tuple[str, str]:
        """Compare ``a`` with ``b`` from now on, loading the one the app does not serve.

        One of the two must be the serving model: the process holds two models at most. On a
        failed load the previous pair stays chosen (its extra model is loaded again when needed)."""
        if same_model(a, b):
            raise CompareError("Pick two different models to compare.")
        extras = [spec for spec in (a, b) if not self.is_serving(spec)]
        if len(extras) > 1:
            raise CompareError(
                "One of the two models must be the one being served: the app holds two models at most "
                "(the serving one and one more). To compare two others, serve one of them first (Chat tab, Model)."
            )
        with self._loading:  # a reply starting meanwhile sees the old pair or the new one, whole
            self._engine_for(extras[0])
            with self._lock:
                self._pair = (a, b)
        return a, b

    def engines(self) -> tuple[tuple[str, ChatEngine], tuple[str, ChatEngine]]:
        """((spec A, engine A), (spec B, engine B)) for a reply; the extra model is loaded again
        if it was freed while idle. Waits while a load is under way."""
        with self._loading:
            pair = self.pair
            if pair is None:
                raise CompareError("No models to compare yet: a trainer chooses them below (Models, Load).")
            if all(not self.is_serving(spec) for spec in pair):
                raise CompareError(
                    "The served model changed since the models to compare were chosen; "
                    "a trainer needs to choose them again (Models, Load)."
                )
            return (pair[0], self._engine_for(pair[0])), (pair[1], self._engine_for(pair[1]))

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
