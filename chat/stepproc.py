"""The step loop in a process of its own (``CHAT_SCHEDULER=process``).

At 64 chats on a GPU the step loop's worker thread spent most of each step waiting to take the GIL
back after its torch calls, while the chats' own threads (prompt building, tokenizing, decoding
text, the server) held it: 10.2 ms of the worker's time for a 2.6 ms step replay
(docs/chat-benchmarks.md). Here the worker runs in a process that does nothing else. The serving
process (the app, the API, a benchmark) keeps its threads and sends each request's source ids and
settings through a pipe; the engine process runs ``chat.stepping.StepBatcher`` unchanged on them
and sends back, once per wake-up of its sender, every row's new token ids and each ended reply,
which this process hands to the request's streamer and future. Same ``submit`` as the others.

The weights are not copied: ``torch.multiprocessing`` hands the engine process this process's
tensors (CUDA IPC handles on a GPU, shared memory on a CPU); there the model's modules are built
on the meta device and take those tensors as their own. Its CUDA graphs, slots and caches are its own.

It takes what the step loop takes of a base model with no adapters attached, in fp32 or bf16
(int8's quantized layers do not travel), one row per request (no beam search); anything else, and
every request once the engine process has failed, is served in this process by a ``StepBatcher``
as before. A model's weights must not change while it is served (the app loads a new model rather
than changing one in place: ``chat.serving``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import threading
import weakref
from concurrent.futures import Future

import torch
import torch.multiprocessing as mp

from chat.batching import hand_ids
from chat.optimize import optimization_of
from chat.rows import beams_of
from chat.stepping import StepBatcher

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300  # the engine process's start and a model's arrival there (imports, CUDA context)


class EngineProcessError(RuntimeError):
    """The engine process ended or refused a model; the message says why."""


class ProcessBatcher:
    """``StepBatcher``'s worker in a process of its own (``devices``: where it serves; by default
    the GPU only, where the worker waits on the GIL; tests pass ``("cpu",)``)."""

    def __init__(self, max_batch: int | None = None, local: StepBatcher | None = None, devices=("cuda",)):
        self.local = local or StepBatcher(max_batch)  # what the engine process does not take
        self.devices = tuple(devices)
        self.sent = 0  # requests the engine process served (tests and benchmarks read it)
        self.broken: str | None = None  # why every request is now served here instead
        self._max_batch = max_batch
        self._lock = threading.RLock()  # one sender on the pipe; RLock: a model freed meanwhile sends ``forget``
        self._conn = None
        self._proc = None
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Future, object]] = {}  # request id -> (future, streamer)
        self._models: dict[int, weakref.ref] = {}  # id(model) -> the model, as sent
        self._refused: set[int] = set()  # models the engine process could not build: served here
        self._acks: dict[int, tuple[threading.Event, list]] = {}

    # The in-process batcher's knobs, for callers that tune them (warm_up, bench.chat).
    max_batch = property(lambda self: self.local.max_batch)
    cuda_graphs = property(lambda self: self.local.cuda_graphs, lambda self, v: setattr(self.local, "cuda_graphs", v))
    window_s = property(lambda self: self.local.window_s, lambda self, v: setattr(self.local, "window_s", v))

    @property
    def pid(self) -> int | None:
        """The engine process's id, once started (benchmarks read its CPU time)."""
        return None if self._proc is None else self._proc.pid

    def takes(self, loaded, kwargs: dict, streamer=None) -> bool:
        """Does the engine process serve this request (else this process's ``StepBatcher``)?"""
        model = loaded.model
        return (
            self.broken is None
            and loaded.adapter is None
            and loaded.host is None
            and model.device.type in self.devices
            and optimization_of(model) in (None, "none", "bf16")
            and id(model) not in self._refused
            and beams_of(kwargs) == 1
            and self.local.takes(loaded, kwargs)
            and (streamer is None or hasattr(streamer, "put_ids"))  # ids arrive as ints
        )

    def submit(self, loaded, encoded: dict, kwargs: dict, streamer=None) -> Future:
        if not self.takes(loaded, kwargs, streamer):
            return self.local.submit(loaded, encoded, kwargs, streamer)
        future = Future()
        # Lists, not tensors: a tensor's pickling shares its storage, more work than 128 ints.
        source = {name: value.tolist() for name, value in encoded.items()}
        try:
            with self._lock:
                self._start()
                key = self._model_key(loaded.model)
                if key is None:  # refused there: served here
                    return self.local.submit(loaded, encoded, kwargs, streamer)
                rid = next(self._ids)
                self._pending[rid] = (future, streamer)
                self._conn.send(("submit", rid, key, source, kwargs, streamer is not None))
        except EngineProcessError as err:
            log.error("the engine process failed (%s); serving in this process from now on", err)
            return self.local.submit(loaded, encoded, kwargs, streamer)
        except (OSError, EOFError) as err:  # the pipe broke under us: the receiver fails what was sent
            self._broke(f"the pipe to the engine process broke ({err})")
        return future

    def close(self) -> None:
        """Stop the engine process (replies in flight there fail)."""
        with self._lock:
            self.broken = self.broken or "the engine process was stopped"
            if self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(("stop",))
                except OSError:
                    pass
                self._proc.join(10)
                if self._proc.is_alive():
                    self._proc.kill()

    # -- this process's side -----------------------------------------------------------------------

    def _start(self) -> None:
        if self.broken is not None:
            raise EngineProcessError(self.broken)
        if self._proc is not None:
            return
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, theirs = ctx.Pipe()
        threads = torch.get_num_threads()
        self._proc = ctx.Process(
            target=_serve, args=(theirs, self._max_batch, threads), daemon=True, name="chat-engine"
        )
        self._proc.start()
        theirs.close()
        atexit.register(self.close)  # before multiprocessing's own exit handler kills it: quietly
        threading.Thread(target=self._receive, daemon=True, name="chat-engine-receiver").start()
        log.info("engine process %d started", self._proc.pid)

    def _model_key(self, model) -> int | None:
        """The model's key in the engine process, sent there (and built) on first use; None when
        the engine process could not build it (logged; it is served here)."""
        key = id(model)
        if key in self._refused:
            return None
        sent = self._models.get(key)
        if sent is not None and sent() is model:
            return key
        state = model.state_dict()
        flags = _precision()
        done, answer = threading.Event(), []
        self._acks[key] = (done, answer)
        mark = optimization_of(model)
        self._conn.send(
            ("model", key, type(model), model.config, model.generation_config, state, mark, flags, self.cuda_graphs)
        )
        if not done.wait(START_TIMEOUT_S):
            raise EngineProcessError(f"the engine process did not take the model in {START_TIMEOUT_S} s")
        self._acks.pop(key, None)
        if self.broken is not None:
            raise EngineProcessError(self.broken)
        if answer[0] is not None:
            log.warning(
                "the engine process could not build %s (%s); it is served in this process",
                type(model).__name__,
                answer[0],
            )
            self._refused.add(key)
            return None
        self._models[key] = weakref.ref(model)
        weakref.finalize(model, self._forget, key)
        return key

    def _forget(self, key: int) -> None:
        """A model this process freed: the engine process lets go of its tensors."""
        with self._lock:
            self._models.pop(key, None)
            self._refused.discard(key)
            if self._conn is not None and self.broken is None:
                try:
                    self._conn.send(("forget", key))
                except (OSError, EOFError):
                    pass

    def _receive(self) -> None:
        """Hand each message's tokens to their streamers, and ended replies to their futures."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(5)
                self._broke(f"the engine process ended (exit code {self._proc.exitcode})")
                return
            if message[0] == "model":  # a model's answer: None (built) or why not
                _, key, error = message
                done, answer = self._acks.get(key, (None, None))
                if done is not None:
                    answer.append(error)
                    done.set()
                continue
            _, tokens, ended = message
            for rid, ids in tokens.items():
                streamer = self._pending.get(rid, (None, None))[1]
                if streamer is not None:
                    hand_ids(streamer, ids)
            for rid, (ok, value) in ended.items():
                future, streamer = self._pending.pop(rid, (None, None))
                if future is None:
                    continue
                if streamer is not None:
                    streamer.end()
                if ok:
                    self.sent += 1
                    future.set_result(torch.tensor([value]))
                else:
                    future.set_exception(value)

    def _broke(self, why: str) -> None:
        """Fail every reply in flight there; serve every later request here."""
        if self.broken is None:  # (else: stopped by close(), or already failed)
            self.broken = why
            log.error("%s; its replies in flight fail, later ones are served in this process", why)
        for done, answer in list(self._acks.values()):  # first: a submit waiting for one holds the lock
            answer.append(why)
            done.set()
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, streamer in pending.values():
            if streamer is not None:
                streamer.end()
            if not future.done():
                future.set_exception(EngineProcessError(why))


# -- the engine process ----------------------------------------------------------------------------


class _Outbox:
    """What the engine process's rows produced since the last send, sent by a thread of its own:
    every row's new ids and the replies that ended (in one message, so ids come before their end)."""

    def __init__(self, conn):
        self.conn = conn
        self.sending = threading.Lock()  # the main thread answers models on the same pipe
        self._ready = threading.Condition()
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, tuple[bool, object]] = {}
        threading.Thread(target=self._send, daemon=True, name="chat-engine-sender").start()

    def put(self, rid: int, ids: list[int]) -> None:
        with self._ready:
            self.tokens.setdefault(rid, []).extend(ids)
            self._ready.notify()

    def end(self, rid: int, future: Future) -> None:
        err = future.exception()
        if err is None:
            value = (True, future.result()[0].tolist())
        else:
            try:
                pickle.dumps(err)
                value = (False, err)
            except Exception:  # noqa: BLE001 - an error that does not pickle travels as its text
                value = (False, EngineProcessError(f"{type(err).__name__}: {err}"))
        with self._ready:
            self.ended[rid] = value
            self._ready.notify()

    def _send(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self.tokens or self.ended)
                tokens, ended, self.tokens, self.ended = self.tokens, self.ended, {}, {}
            with self.sending:
                self.conn.send(("out", tokens, ended))


class _Ids:
    """A request's streamer in the engine process: its ids go to the outbox."""

    def __init__(self, outbox: _Outbox, rid: int):
        self.outbox, self.rid = outbox, rid

    def put_ids(self, ids: list[int]) -> None:
        self.outbox.put(self.rid, ids)

    def put(self, value: torch.Tensor) -> None:
        self.put_ids(value.reshape(-1).tolist())

    def end(self) -> None:  # the reply's end travels with its result (_Outbox.end)
        pass


# Where fp32 products may round as TF32 (torch's own settings, the new API only: reading the legacy
# ``allow_tf32`` after the new one was set raises). The engine process computes as this one.
_PRECISIONS = (
    (torch.backends, "fp32_precision"),  # first: setting it resets the others
    (torch.backends.cuda.matmul, "fp32_precision"),
    (torch.backends.cudnn.conv, "fp32_precision"),
    (torch.backends.cudnn.rnn, "fp32_precision"),
)


def _precision(flags: list | None = None) -> list:
    """These settings now, or (``flags``) set to those."""
    if flags is not None:
        for (where, name), value in zip(_PRECISIONS, flags):
            setattr(where, name, value)
    return [getattr(where, name) for where, name in _PRECISIONS]


def _build(cls, config, generation_config, state: dict, mark, flags: list):
    """The served model, on the tensors this process was handed (none copied)."""
    from chat.loading import LoadedModel
    from chat.optimize import _MARK

    _precision(flags)
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(state, strict=True, assign=True)
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"tensors the model's state does not hold: {', '.join(left[:5])}")
    model.generation_config = generation_config
    model.eval()
    model.requires_grad_(False)
    if mark is not None:
        setattr(model, _MARK, mark)
    return LoadedModel(name="engine", model=model, tokenizer=None, prefix="", max_source_length=0, trained_args=None)


def _serve(conn, max_batch: int | None, threads: int) -> None:
    """The engine process: build the models it is sent, step their requests, send what they produce."""
    torch.set_num_threads(threads)
    stepper = StepBatcher(max_batch)
    outbox = _Outbox(conn)
    models: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the serving process is gone
            os._exit(0)
        kind = message[0]
        if kind == "submit":
            _, rid, key, source, kwargs, streams = message
            try:
                encoded = {name: torch.tensor(value) for name, value in source.items()}
                streamer = _Ids(outbox, rid) if streams else None
                future = stepper.submit(models[key], encoded, kwargs, streamer)
            except Exception as err:  # noqa: BLE001 - this request fails, not the process
                future = Future()
                future.set_exception(err)
            future.add_done_callback(lambda f, rid=rid: outbox.end(rid, f))
        elif kind == "model":
            _, key, cls, config, generation_config, state, mark, flags, graphs = message
            try:
                models[key] = _build(cls, config, generation_config, state, mark, flags)
                stepper.cuda_graphs = graphs
                error = None
            except Exception as err:  # noqa: BLE001 - the serving process serves it itself
                error = f"{type(err).__name__}: {err}"
            del state
            with outbox.sending:
                conn.send(("model", key, error))
        elif kind == "forget":
            models.pop(message[1], None)
        elif kind == "stop":
            # At once: a normal exit would finalize the interpreter under the step loop's threads.
            os._exit(0)
