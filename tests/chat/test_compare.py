"""The Compare view's model slot (chat/compare.py): at most one extra base model beside the serving
one, the serving engine reused (adapters of its base attached to it), the extra model freed when
idle. Real models: the bundled demo model serves, the tiny preset (and a copy of it) is the extra
model, and LoRA adapters made with peft (tests/adapter_files.py) sit on either."""

import gc
import shutil
import time
import weakref

import pytest
from adapter_files import make_adapter
from transformers import BlenderbotForConditionalGeneration

from chat.compare import CompareError, CompareSlot, same_model
from chat.engine import DEMO_DIR, ChatEngine, Conversation, load_checkpoint


@pytest.fixture(scope="module")
def serving():
    return ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingLoader:
    def __init__(self):
        self.specs = []

    def __call__(self, spec, optimize=None):
        self.specs.append(spec)
        return load_checkpoint(spec, optimize=optimize)


@pytest.fixture
def slot(serving):
    loader, clock = CountingLoader(), Clock()
    made = CompareSlot(serving, optimize="none", idle_seconds=600, loader=loader, clock=clock)
    made.loader, made.clock = loader, clock
    return made


@pytest.fixture(scope="module")
def tiny_copy(tiny_path, tmp_path_factory):
    """Another extra model: the tiny preset in a folder of its own."""
    copy = tmp_path_factory.mktemp("copy") / "tiny-copy"
    shutil.copytree(tiny_path, copy)
    return copy


def model_ref(engine: ChatEngine) -> weakref.ref:
    return weakref.ref(engine.current.model)


def test_load_gives_an_engine_of_its_own_that_replies(slot, serving, tiny_path):
    extra = slot.load(str(tiny_path))
    assert extra is not serving and extra is slot.extra
    assert slot.loaded_spec == str(tiny_path) and slot.loader.specs == [str(tiny_path)]
    assert extra.current.name == str(tiny_path) and extra.current.model is not serving.current.model
    reply = extra.respond(Conversation("persona", "i love dogs."), "hello there")
    assert isinstance(reply, str)
    assert slot.load(str(tiny_path)) is extra and slot.loader.specs == [str(tiny_path)]  # loaded once
    assert slot.load(str(tiny_path) + "/") is extra  # the same folder, spelled differently


def test_the_serving_model_is_never_loaded_twice(slot, serving):
    assert slot.load(str(DEMO_DIR)) is serving
    assert slot.load(str(DEMO_DIR / ".." / "demo_model")) is serving
    assert slot.loader.specs == [] and slot.extra is None


def test_two_models_at_most(slot, tiny_path, tiny_copy):
    first = model_ref(slot.load(str(tiny_path)))
    second = slot.load(str(tiny_copy))
    gc.collect()
    assert first() is None  # the previous extra model is freed when another one is loaded
    assert slot.loaded_spec == str(tiny_copy) and second.current.name == str(tiny_copy)
    # A pair in which neither model is the serving one would need a third model: refused.
    with pytest.raises(CompareError, match="must be the one being served"):
        slot.choose(str(tiny_path), str(tiny_copy))
    with pytest.raises(CompareError, match="two different models"):
        slot.choose(str(tiny_path), str(tiny_path) + "/")
    assert slot.pair is None and slot.loader.specs == [str(tiny_path), str(tiny_copy)]


def test_idle_unload_frees_the_model_and_the_next_reply_loads_it_again(slot, serving, tiny_path):
    assert slot.unload_if_idle() is False  # nothing loaded
    slot.choose(str(DEMO_DIR), str(tiny_path))
    ref = model_ref(slot.extra)
    slot.clock.now += 599
    assert slot.unload_if_idle() is False and ref() is not None  # used 599 s ago: kept
    (spec_a, engine_a, id_a), (spec_b, engine_b, id_b) = slot.engines()  # a use restarts the idle clock
    assert (spec_a, spec_b) == (str(DEMO_DIR), str(tiny_path)) and engine_a is serving
    assert (id_a, id_b) == ("demo-model", "tiny")  # what each side's conversation names
    slot.clock.now += 599
    assert slot.unload_if_idle() is False
    del engine_b
    slot.clock.now += 1
    assert slot.unload_if_idle() is True
    gc.collect()
    assert ref() is None and slot.extra is None and slot.loaded_spec is None
    assert slot.pair == (str(DEMO_DIR), str(tiny_path))  # the choice stays
    (_, again, _), (_, extra, _) = slot.engines()
    assert again is serving and extra is slot.extra and slot.loader.specs == [str(tiny_path)] * 2


def test_no_pair_or_a_pair_the_serving_model_left(slot, tiny_path, tiny_copy):
    with pytest.raises(CompareError, match="No models to compare yet"):
        slot.engines()
    serving = ChatEngine(load_checkpoint(str(tiny_copy), optimize="none"), f"serving {tiny_copy}")
    moved = CompareSlot(serving, optimize="none")
    moved.choose(str(tiny_copy), str(tiny_path))
    serving.swap(str(DEMO_DIR))  # a trainer serves another model (Chat tab)
    # The pair now needs two extra models: refused (a trainer chooses again) rather than
    # swapping models in and out of memory for every reply.
    with pytest.raises(CompareError, match="served model changed"):
        moved.engines()


def test_a_failed_load_keeps_the_pair(slot, tiny_path, tmp_path):
    slot.choose(str(DEMO_DIR), str(tiny_path))
    with pytest.raises(Exception, match="no such model folder"):
        slot.choose(str(DEMO_DIR), str(tmp_path / "missing"))
    assert slot.pair == (str(DEMO_DIR), str(tiny_path))
    assert slot.engines()[1][1].current.name == str(tiny_path)


def test_the_reaper_frees_an_idle_model_and_ends_with_the_slot(serving, tiny_path):
    slot = CompareSlot(serving, optimize="none", idle_seconds=0)
    ref = model_ref(slot.load(str(tiny_path)))
    thread = slot.start_reaper(interval=0.02)
    deadline = time.monotonic() + 10
    while slot.extra is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    gc.collect()
    assert slot.extra is None and ref() is None
    del slot
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_same_model():
    assert same_model(str(DEMO_DIR), str(DEMO_DIR / "."))
    assert same_model("facebook/x", "facebook/x")
    assert not same_model("facebook/x", "facebook/y") and not same_model(None, "a") and not same_model("", "")


# --------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def demo_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: make_adapter(DEMO_DIR, root / name, seed=seed) for seed, name in enumerate(("bob", "ann"))}


def base_models() -> int:
    """Base models alive in this process."""
    gc.collect()
    return sum(isinstance(o, BlenderbotForConditionalGeneration) for o in gc.get_objects())


def test_two_adapters_of_the_serving_base_compare_on_one_base(demo_adapters, tiny_path):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "serving the demo model")
    loader = CountingLoader()
    slot = CompareSlot(engine, optimize="none", loader=loader)
    slot.choose(str(DEMO_DIR), str(tiny_path))  # a full model: an extra base, as before
    extra = weakref.ref(slot.extra.current.model)
    models = base_models()
    bob, ann = (str(demo_adapters[name].parent) for name in ("bob", "ann"))
    slot.choose(bob, ann)
    assert base_models() == models - 1 and extra() is None and slot.extra is None  # the extra base left
    assert loader.specs == [str(tiny_path)]  # nothing loaded for the adapters
    (_, engine_a, id_a), (_, engine_b, id_b) = slot.engines()
    assert engine_a is engine_b is engine and (id_a, id_b) == ("bob", "ann")
    assert engine.current.id == "demo-model"  # comparing does not change what the chat serves
    replies = [engine.reply(Conversation("persona", "i love dogs.", model=i), "hello there")[0] for i in (id_a, id_b)]
    assert replies[0] != replies[1]  # each side answers with its own adapter
    assert engine.model_for("bob").model is engine.model_for("ann").model is engine.current.model  # one base
    slot.choose(str(DEMO_DIR), bob)  # an adapter against its base: one base too
    assert slot.extra is None and base_models() == models - 1 and loader.specs == [str(tiny_path)]
    assert [side[2] for side in slot.engines()] == ["demo-model", "bob"]


def test_adapters_of_another_base_share_one_extra_base(serving, tiny_path, tmp_path):
    loader = CountingLoader()
    slot = CompareSlot(serving, optimize="none", loader=loader)
    carl, dora = (make_adapter(tiny_path, tmp_path / n, seed=s) for s, n in ((3, "carl"), (4, "dora")))
    slot.choose(str(carl), str(dora))
    assert loader.specs == [str(tiny_path)]  # their base, once
    (_, engine_a, id_a), (_, engine_b, id_b) = slot.engines()
    assert engine_a is engine_b is slot.extra and engine_a is not serving and (id_a, id_b) == ("carl", "dora")
    assert engine_a.base.id == "tiny" and serving.model_ids() == ["demo-model"]  # the chat is untouched
    other = make_adapter(DEMO_DIR, tmp_path / "eve", seed=5)
    with pytest.raises(CompareError, match="must be the one being served"):
        slot.choose(str(carl), str(tiny_path / ".." / "nothing-like-it"))  # two other bases: refused
    slot.choose(str(other), str(dora))  # one on the serving base, one on the extra base
    assert loader.specs == [str(tiny_path)] and [side[2] for side in slot.engines()] == ["eve", "dora"]
