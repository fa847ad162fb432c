"""Many LoRA adapters on one base model, each served as a model of its own.

A ``Host`` is one loaded base model and the adapters attached to it. peft puts each adapter's A and
B matrices beside the base's linear layers, on the same model object (``peft.functional``: inject
the layers, load the adapter's state dict, set the active adapter), so attaching one reads a few
MB and the base is never loaded again. The base keeps serving itself with no adapter active.

Which adapter answers is switched per batch, on the batcher's worker thread, in ``Host.serving``,
under the host's lock, which attaching and unloading take too: nothing changes the model while a
generate() runs on it. The static batcher (``chat.batching``) keys batches by ``LoadedModel``, so
requests for different adapters do not share a generate() call; the step loop (``chat.stepping``)
runs them in one decoder step, each row through its own adapter (``Host.rows``: peft's mixed-batch
forward, one adapter per row).

Adapters are bounded by memory (``CHAT_ADAPTER_MEMORY_MB``, default 512 MiB: about 36 adapters of
rank 8 on every projection of the 400M model, 18 of rank 16; a third of that model's fp32 weights):
the least recently used are unloaded first (``ChatEngine`` decides, never the one new chats start
with). A reply on an adapter unloaded after the request was made attaches it again first.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftConfig, PeftType
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import SafetensorError
from safetensors.torch import load_file

from chat.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_of, is_adapter_dir
from chat.layout import FINAL
from chat.loading import CheckpointError, LoadedModel, input_format, load_apart, model_id, training_args
from chat.lora import ServedLoraLinear, rows_of, stackable
from chat.model import MODEL_PRESETS, ModelLoadError, load_tokenizer, resolve

log = logging.getLogger(__name__)

MEMORY_ENV = "CHAT_ADAPTER_MEMORY_MB"
DEFAULT_MEMORY_MB = 512


class AdapterError(CheckpointError):
    """An adapter cannot serve on the base found (another base, shapes that do not fit, bad files)."""


def adapter_dir(spec: str) -> Path | None:
    """The adapter folder ``spec`` names (itself, or a run folder's ``final/``), or None when it
    names no adapter (a full model, a Hub id, a preset)."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return None
    for folder in (path, path / FINAL):
        if is_adapter_dir(folder):
            return folder.resolve()
    return None


def list_adapter_finals(root: str | Path) -> list[Path]:
    """``RUN/final/`` folders under ``root`` that hold a LoRA adapter, newest first."""
    found = [p.parent for p in Path(root).glob(f"*/{FINAL}/{ADAPTER_CONFIG}") if is_adapter_dir(p.parent)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def named_base(folder: Path) -> tuple[str, str | None]:
    """``chat.adapters.base_of``, its errors as AdapterError naming the adapter by id, not path."""
    try:
        return base_of(folder)
    except ValueError as err:
        why = str(err).removeprefix(f"{folder / ADAPTER_CONFIG}: ")
        raise AdapterError(f"{model_id(str(folder))}: {ADAPTER_CONFIG}: {why}") from None


def canonical(spec: str) -> str:
    """One spelling per model, to tell whether two specs name the same one: a local folder (a
    preset's too) as its resolved model folder; a Hub id as given."""
    path = Path(resolve(spec) if spec in MODEL_PRESETS else spec).expanduser()
    if not path.is_dir():
        return spec
    path = path.resolve()
    return str(path / FINAL) if (path / FINAL).is_dir() and not (path / "config.json").is_file() else str(path)


def memory_budget() -> int:
    """Bytes the adapters of one base may hold (``CHAT_ADAPTER_MEMORY_MB``)."""
    value = os.environ.get(MEMORY_ENV, str(DEFAULT_MEMORY_MB))
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"{MEMORY_ENV} must be a number of megabytes, got {value!r}") from None
    if megabytes < 0:
        raise ValueError(f"{MEMORY_ENV} must be >= 0, got {value!r}")
    return int(megabytes * 2**20)


def base_matches(base: LoadedModel, name: str, fingerprint: str | None) -> bool:
    """Is ``base`` the model an adapter names (``chat.adapters.base_of``)? The same fingerprint
    when one was recorded (a base is recognised whatever its folder is called now); else the same
    name (an adapter trained elsewhere records none)."""
    if fingerprint is not None:
        return base.fingerprint == fingerprint
    return canonical(name) == canonical(base.name)


@dataclass
class _Attached:
    folder: Path
    bytes: int
    stamp: tuple[int, int]  # the weights file's (mtime, size) when attached


def _why(err: Exception) -> str:
    """The telling line of a failed attach: torch's first size mismatch, else the first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    shapes = [line for line in lines if line.startswith("size mismatch")]
    if shapes:
        return f"shapes differ ({shapes[0].removeprefix('size mismatch for ')})"
    return lines[0][:300] if lines else type(err).__name__


def _stamp(folder: Path) -> tuple[int, int]:
    stat = (folder / ADAPTER_WEIGHTS).stat()
    return stat.st_mtime_ns, stat.st_size


class Host:
    """A base model and the adapters attached to it; thread-safe.

    ``serving`` runs a generate() as one of them; ``attach``/``detach`` change the set. Adapter
    names on the model are the host's own (``adapter_1``...): peft names modules by them."""

    def __init__(self, base: LoadedModel, budget_bytes: int | None = None):
        self.model = base.model
        self.budget_bytes = memory_budget() if budget_bytes is None else budget_bytes
        self.lock = threading.RLock()
        self._attached: OrderedDict[str, _Attached] = OrderedDict()  # least recently used first
        self._active: tuple[str | None] | None = None  # what the LoRA layers have active (None: unknown)
        self._wrapped = False  # has peft put LoRA layers in the model yet?
        self._made = 0
        # Lanes for steps of many adapters recorded once (``by_lanes``): an adapter keeps its lane
        # while attached; lane 0 is the base. ``version`` counts the changes to the adapters'
        # weights: a recorded step read stacks made from the weights of its version.
        self._lanes: list[str | None] = [None]
        self.version = 0
        self._plan: tuple | None = None  # (version, the largest rank, adapters by_lanes cannot serve)

    def new_name(self) -> str:
        with self.lock:
            self._made += 1
            return f"adapter_{self._made}"

    # --- the set of adapters
    def attached(self) -> list[str]:
        """The attached adapters' names, least recently used first."""
        with self.lock:
            return list(self._attached)

    def has(self, name: str) -> bool:
        with self.lock:
            return name in self._attached

    def adapter_bytes(self) -> int:
        with self.lock:
            return sum(a.bytes for a in self._attached.values())

    def attach(self, folder: Path, name: str, label: str, base_label: str) -> None:
        """Put the adapter in ``folder`` on the model as ``name``. ``label`` and ``base_label`` name
        the adapter and the base in errors (public ids, not paths). Raises AdapterError, leaving
        the model as it was, if it does not fit."""
        try:
            config = PeftConfig.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError) as err:  # unreadable JSON, unknown fields or type
            raise AdapterError(f"{label}: unreadable {ADAPTER_CONFIG} ({_why(err)})") from None
        if config.peft_type != PeftType.LORA:
            raise AdapterError(f"{label} is a {config.peft_type.value} adapter; the chat serves LoRA adapters.")
        if getattr(config, "modules_to_save", None):
            raise AdapterError(
                f"{label} also saves whole layers ({', '.join(config.modules_to_save)}); "
                "the chat serves adapters that only add LoRA weights."
            )
        config.inference_mode = True
        # peft builds our Linear where it would build its own (the same numbers, a leaner forward).
        config._register_custom_module({torch.nn.Linear: ServedLoraLinear})
        try:
            stamp = _stamp(folder)
            state = load_file(str(folder / ADAPTER_WEIGHTS))
        except (OSError, SafetensorError) as err:
            raise AdapterError(f"{label}: unreadable {ADAPTER_WEIGHTS} ({err})") from None
        everything = torch.cat([t.detach().reshape(-1).float() for t in state.values()]) if state else torch.zeros(0)
        if not torch.isfinite(everything).all():  # one pass over all of it; the names only when it fails
            bad = sorted(key for key, tensor in state.items() if not torch.isfinite(tensor).all())
            raise AdapterError(f"{label}: non-finite weights in {', '.join(bad[:3])}")
        del everything
        with self.lock:
            if name in self._attached:
                raise ValueError(f"an adapter named {name!r} is attached already")
            try:
                # low_cpu_mem_usage: the new layers start empty (no random init) and take the
                # loaded tensors, then peft moves them to the base layers' device and dtype.
                with warnings.catch_warnings():  # "multiple adapters in the model": that is the point
                    warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                    inject_adapter_in_model(config, self.model, adapter_name=name, low_cpu_mem_usage=True)
                self._wrapped = True
                self.model.eval()  # the new layers too: their dropout must not drop at inference
                result = set_peft_model_state_dict(self.model, state, adapter_name=name, low_cpu_mem_usage=True)
                missing = [k for k in result.missing_keys if f".{name}." in k]
                if result.unexpected_keys or missing:
                    keys = [*result.unexpected_keys, *missing]
                    raise AdapterError(f"its weights do not match the model's layers ({', '.join(keys[:2])})")
            except (AdapterError, RuntimeError, ValueError, KeyError) as err:
                self._remove(name)
                raise AdapterError(f"{label} does not fit {base_label}, the model found: {_why(err)}") from None
            size = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if f".{name}." in n)
            self._attached[name] = _Attached(folder, size, stamp)
            if None in self._lanes[1:]:
                self._lanes[self._lanes.index(None, 1)] = name
            else:
                self._lanes.append(name)
            self.version += 1
            self._active = None  # injecting may leave other layers active than the ones set last

    def changed(self, name: str) -> bool:
        """Has adapter ``name``'s weights file changed on disk since it was attached (retrained)?"""
        with self.lock:
            attached = self._attached.get(name)
        try:
            return attached is not None and _stamp(attached.folder) != attached.stamp
        except OSError:
            return True

    def touch(self, name: str | None) -> None:
        """Mark adapter ``name`` as just used (a request for it is on its way)."""
        with self.lock:
            if name in self._attached:
                self._attached.move_to_end(name)

    def detach(self, name: str) -> bool:
        """Unload adapter ``name`` (False if it was not attached)."""
        with self.lock:
            if self._attached.pop(name, None) is None:
                return False
            self._remove(name)
            return True

    def _remove(self, name: str) -> None:  # with the lock held; also undoes a half-done attach
        delete_adapter(self.model, name, prefix="lora_")
        getattr(self.model, "peft_config", {}).pop(name, None)
        self._active = None
        self._lanes = [None if held == name else held for held in self._lanes]
        while len(self._lanes) > 1 and self._lanes[-1] is None:
            self._lanes.pop()
        self.version += 1

    # --- answering
    @contextmanager
    def serving(self, loaded: LoadedModel):
        """Run the body (a generate() call) as ``loaded``: its adapter active, or none for the base."""
        with self.lock:
            name = loaded.adapter
            if name is not None:
                if name not in self._attached:  # unloaded since the request was made: attach again
                    log.info("attaching %s again", loaded.id)
                    self.attach(loaded.folder, name, loaded.id, "its base")
                self._attached.move_to_end(name)
            if self._wrapped and self._active != (name,):
                set_adapter(self.model, [name] if name else [], inference_mode=True)
                self._active = (name,)
            yield

    @contextmanager
    def rows(self, loadeds: list[LoadedModel]):
        """Run the body (one decoder step of a batch, ``chat.stepping``) with row ``i`` answered as
        ``loadeds[i]``: each through its own adapter (or none), attached again if unloaded."""
        with self.lock:
            self._present(loadeds)
            with rows_of([loaded.adapter for loaded in loadeds]):
                yield

    def shares(self, name: str) -> bool:
        """Can adapter ``name``'s rows share a step with other adapters' rows (plain LoRA)? peft's
        mixed batches refuse DoRA, and ``by_lanes`` serves plain LoRA only."""
        with self.lock:
            return name not in self._lane_plan()[1]

    def _lane_plan(self) -> tuple[int, set[str]]:  # with the lock held
        """The largest rank of the adapters' layers, and the adapters ``by_lanes`` cannot serve."""
        if self._plan is None or self._plan[0] != self.version:
            layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
            rank = max((r for layer in layers for r in layer.r.values()), default=1)
            # Not ours (an embedding's LoRA) or not plain: only peft's own forward serves it.
            odd = {
                name
                for layer in layers
                for name in layer.r
                if not isinstance(layer, ServedLoraLinear) or not stackable(layer, name)
            }
            self._plan = (self.version, rank, odd)
        return self._plan[1:]

    def _present(self, loadeds: list[LoadedModel]) -> None:  # with the lock held
        for loaded in {id(x): x for x in loadeds}.values():
            name = loaded.adapter
            if name is not None:
                if name not in self._attached:
                    log.info("attaching %s again", loaded.id)
                    self.attach(loaded.folder, name, loaded.id, "its base")
                self._attached.move_to_end(name)

    @contextmanager
    def lanes(self, loadeds: list[LoadedModel]):
        """Hold the adapters as they are for a step of ``loadeds``' rows (each attached again if
        unloaded) and yield how ``chat.lora.by_lanes`` serves them: (lanes, the rank of a lane's
        block, ``version``, each one's lane, 0 for the base); None where one of their adapters is not
        plain LoRA (DoRA, a bias of its own: peft's own forward serves those)."""
        with self.lock:
            self._present(loadeds)
            rank, odd = self._lane_plan()
            if any(loaded.adapter in odd for loaded in loadeds):
                yield None
            else:
                yield tuple(self._lanes), rank, self.version, [self._lanes.index(x.adapter) for x in loadeds]


def adapter_model(base: LoadedModel, folder: Path, public_id: str, named: str | None = None) -> LoadedModel:
    """The adapter in ``folder`` attached to ``base`` (whose ``host`` is made if it has none), as a
    model the engine serves: its own tokenizer and input format (training_args.json), the base's
    model object. ``named`` is the base the adapter names (for errors). Raises AdapterError if it
    does not fit."""
    if base.host is None:
        base.host = Host(base)
    host: Host = base.host
    trained = training_args(folder)
    tokenizer = base.tokenizer
    if (folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file():
        tokenizer = load_tokenizer(str(folder))  # the tokenizer it was trained with
        if len(tokenizer) != len(base.tokenizer):
            raise AdapterError(
                f"{public_id}'s tokenizer has {len(tokenizer)} tokens, {base.id}'s {len(base.tokenizer)}: "
                "another base model"
            )
    name = host.new_name()
    label = public_id if named is None else f"{public_id} (a LoRA adapter of {model_id(named)})"
    host.attach(folder, name, label, base.id)
    prefix, max_len = input_format(trained, base.model.config.max_position_embeddings)
    return LoadedModel(
        str(folder), base.model, tokenizer, prefix, max_len, trained, base.fingerprint, public_id, name, folder, host
    )


def mismatch(adapter_id: str, base_name: str, fingerprint: str, found: LoadedModel) -> AdapterError:
    """The refusal of an adapter whose recorded base is not the model found under its name."""
    return AdapterError(
        f"{adapter_id} was trained on {model_id(base_name)} (fingerprint {fingerprint}), but the model "
        f"found as {found.id} is another one (fingerprint {found.fingerprint}): refusing it, its replies "
        "would be noise. Retrain it on this base, or put the base it was trained on back."
    )


class Models:
    """The models one engine can serve now, by public id: a base and the adapters on it (attached,
    or unloaded and attached again on demand); thread-safe.

    Ids are unique among every model served since start: a different model whose name gives the
    same id gets a suffix (``bob-2``), so a conversation's id never silently means another model."""

    MAX_KNOWN = 1000  # ids remembered (for their notes and uniqueness); the oldest are forgotten
    MAX_UNLOADED = 64  # unloaded adapters kept ready to attach again; older ones are forgotten

    def __init__(self, base: LoadedModel):
        self._lock = threading.RLock()
        self._known: OrderedDict[str, str] = OrderedDict()  # id -> canonical spec
        self._models: dict[str, LoadedModel] = {}  # on the current base
        self.base = base
        self.set_base(base)

    def claim(self, spec: str, key: str | None = None) -> str:
        """The public id for ``spec`` (``key``: its canonical spelling)."""
        key = key or canonical(spec)
        wanted = model_id(spec)
        with self._lock:
            n, found = 1, wanted
            while found in self._known and self._known[found] != key:
                n += 1
                found = f"{wanted}-{n}"
            self._known[found] = key
            self._known.move_to_end(found)
            while len(self._known) > self.MAX_KNOWN:
                self._known.popitem(last=False)
            return found

    def set_base(self, base: LoadedModel) -> None:
        """Serve ``base`` (and no adapter yet): the previous base's adapters do not fit it."""
        base.id = self.claim(base.name)
        with self._lock:
            self.base = base
            self._models = {base.id: base}

    def add(self, adapter: LoadedModel) -> None:
        with self._lock:
            old = self._models.get(adapter.id)
            self._models[adapter.id] = adapter
            adapters = [m for m in self._models.values() if m.adapter is not None and not self.attached(m)]
            for stale in adapters[: max(0, len(adapters) - self.MAX_UNLOADED)]:
                del self._models[stale.id]
        if old is not None and old.adapter is not None and old is not adapter:
            old.host.detach(old.adapter)  # the previous version of a retrained adapter

    def get(self, model_id: str) -> LoadedModel | None:
        with self._lock:
            return self._models.get(model_id)

    def by_folder(self, folder: Path) -> LoadedModel | None:
        with self._lock:
            return next((m for m in self._models.values() if m.folder == folder), None)

    def known(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._known

    def ids(self) -> list[str]:
        """Every id this engine can serve now: the base, then its adapters (attached or not)."""
        with self._lock:
            return list(self._models)

    @staticmethod
    def attached(loaded: LoadedModel) -> bool:
        return loaded.adapter is None or loaded.host.has(loaded.adapter)

    def evict(self, keep: LoadedModel) -> list[str]:
        """Unload the least recently used adapters of the base until they fit its memory budget;
        never ``keep`` (what new chats start with). Returns the ids unloaded."""
        host: Host | None = self.base.host
        if host is None:
            return []
        with self._lock:
            by_name = {m.adapter: m for m in self._models.values() if m.adapter is not None}
        unloaded = []
        for name in host.attached():  # least recently used first
            if host.adapter_bytes() <= host.budget_bytes:
                break
            loaded = by_name.get(name)
            if loaded is keep:
                continue
            host.detach(name)
            unloaded.append(loaded.id if loaded else name)
        if unloaded:
            log.info("unloaded adapters %s (least recently used; %s MB budget)", unloaded, host.budget_bytes >> 20)
        return unloaded


def load_base(folder, name: str, fingerprint: str | None, optimize: str | None) -> LoadedModel:
    """Load the base an adapter names; refused (naming both) if it is not the one it was trained on."""
    try:
        base = load_apart(name, optimize)
    except (CheckpointError, ModelLoadError) as err:
        raise AdapterError(
            f"{model_id(str(folder))}: its base model {model_id(name)} cannot be loaded ({err})"
        ) from None
    if fingerprint is not None and base.fingerprint != fingerprint:
        raise mismatch(model_id(str(folder)), name, fingerprint, base)
    return base
