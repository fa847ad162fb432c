"""Rows of different LoRA adapters through one forward with no Python per adapter (``chat.lora.by_lanes``,
the host's lanes: ``chat.serving.Host.lanes``), as the GPU's slots record their steps, on the demo
model and real peft adapters: each row gets what peft's forward gives it with its adapter active."""

from __future__ import annotations

import pytest
import torch
from adapter_files import make_adapter
from test_stepgraphs import faked
from test_stepping import FAST, TALKS, Tokens, alone

from chat.batching import Batcher, Request
from chat.engine import DEMO_DIR, ChatEngine, load_checkpoint
from chat.lora import by_lanes, lane_mask
from chat.stepgraphs import SlotBatch
from chat.stepping import StepBatcher

# (name, rank, layers): different ranks, one adapter of the attention's q/v only.
ADAPTERS = [("bob", 4, None), ("ann", 8, None), ("eve", 2, ("q_proj", "v_proj"))]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An engine on the demo model with three adapters attached: (engine, [bob, ann, eve, base])."""
    root = tmp_path_factory.mktemp("lanes")
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test", batcher=Batcher())
    for seed, (name, r, targets) in enumerate(ADAPTERS):
        kwargs = {"targets": targets} if targets else {}
        engine.load(str(make_adapter(DEMO_DIR, root / name, seed=seed, r=r, **kwargs)))
    return engine, [engine.model_for(name) for name, _, _ in ADAPTERS] + [engine.model_for("demo-model")]


def _logits(loaded, encoded, decoder):
    return loaded.model(**encoded, decoder_input_ids=decoder).logits


def test_each_row_through_its_own_adapter_gives_peft_s_numbers(served):
    engine, loadeds = served
    order = [loadeds[i] for i in (0, 3, 1, 2, 1)]  # two rows of one adapter, the base between
    encoded, _ = engine.build_input(TALKS[0], loadeds[0])
    batch = {k: v.repeat(len(order), 1) for k, v in encoded.items()}
    decoder = torch.tensor([[1, 263, 421, 16]] * len(order))
    with torch.inference_mode():
        expected = []
        for i, loaded in enumerate(order):
            with loaded.activated():  # peft's forward with this adapter active (or none)
                expected.append(_logits(loaded, {k: v[i : i + 1] for k, v in batch.items()}, decoder[i : i + 1])[0])
        with loadeds[3].activated():
            base = _logits(loadeds[3], batch, decoder)  # the same batch, no adapter: the base's rows' bits
        host = loadeds[0].host
        with host.lanes(order) as (lanes, rank, version, each):
            assert lanes[1:] == tuple(loaded.adapter for loaded in loadeds[:3]) and rank == 8
            assert each == [1, 0, 2, 3, 2]
            mask = lane_mask(torch.tensor(each), len(lanes), rank, torch.float32)
            with by_lanes(lanes, rank, mask):
                got = _logits(order[0], batch, decoder)
    for i, loaded in enumerate(order):
        if loaded.adapter is None:  # the base's rows: exact zeros added
            assert torch.equal(got[i], base[i])
        else:
            torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-5)
            assert not torch.allclose(got[i], expected[1], atol=1e-3)  # the adapter does change it


def test_an_adapter_keeps_its_lane_and_a_freed_lane_is_reused(served, tmp_path):
    engine, loadeds = served
    host = loadeds[0].host
    with host.lanes(loadeds) as (lanes, _, before, _each):
        pass
    assert lanes == (None, *(loaded.adapter for loaded in loadeds[:3]))
    assert host.detach(loadeds[1].adapter)
    assert host.version > before
    extra = engine.load(str(make_adapter(DEMO_DIR, tmp_path / "zed", seed=9)))
    with host.lanes([extra, loadeds[0], loadeds[2]]) as (lanes, _, _version, each):
        assert each == [2, 1, 3]  # the new adapter took the freed lane; the others kept theirs
    # The unloaded one is attached again when its rows step, in the next free lane.
    with host.lanes([loadeds[1]]) as (lanes, _, _version, each):
        assert each == [4] and lanes[4] == loadeds[1].adapter
    host.detach(extra.adapter)


def test_an_adapter_only_peft_serves_is_served_alone(served, tmp_path):
    """A DoRA adapter: the host's lanes refuse it (None) and so do peft's mixed batches, so the step
    loop hands its requests to the static batcher (peft's own forward, it alone active) while the
    others' rows step in the slots; each reply is its own alone."""
    engine, loadeds = served
    dora = engine.load(str(make_adapter(DEMO_DIR, tmp_path / "dora", seed=5, dora=True)))
    with dora.host.lanes([dora, loadeds[0]]) as plan:
        assert plan is None
    with dora.host.lanes(loadeds) as plan:
        assert plan is not None  # the others still go by lanes
    requests = []
    for i, loaded in enumerate([dora, loadeds[0], loadeds[3]]):
        encoded, _ = engine.build_input(TALKS[i], loaded)
        requests.append((loaded, encoded, FAST.generate_kwargs()))
    expected = [alone(engine._batcher, *r) for r in requests]
    stepper = StepBatcher()
    stepper.slots = True
    assert not stepper.takes(dora, FAST.generate_kwargs()) and stepper.takes(loadeds[0], FAST.generate_kwargs())
    # An adapter with a LoRA embedding (peft's own layer, not ours) likewise.
    embedding = engine.load(str(make_adapter(DEMO_DIR, tmp_path / "emb", seed=6, targets=("q_proj", "embed_tokens"))))
    assert not embedding.host.shares(embedding.adapter) and not stepper.takes(embedding, FAST.generate_kwargs())
    embedding.host.detach(embedding.adapter)
    futures = [stepper.submit(*r) for r in requests]
    assert [f.result(60)[0].tolist() for f in futures] == expected
    dora.host.detach(dora.adapter)


def test_rows_keep_their_replies_when_their_adapter_moves_lanes(served, tmp_path):
    """Rows of two adapters in slots; after two steps one adapter is unloaded and another takes its
    lane: at the next step the rows' adapter is attached again in a new lane and the rows follow it.
    Every reply is the one generate() gives alone."""
    engine, loadeds = served
    host = loadeds[0].host
    requests = []
    for i, loaded in enumerate([loadeds[0], loadeds[2], loadeds[3]]):
        encoded, _ = engine.build_input(TALKS[i], loaded)
        requests.append((loaded, encoded, FAST.generate_kwargs()))
    expected = [alone(engine._batcher, *r) for r in requests]
    batch = SlotBatch(loadeds[0].model, 4, graphs=False)
    out, steps = {}, 0
    with torch.inference_mode():
        batch.join_all([Request(*r, Tokens()) for r in requests])
        rows = list(batch.rows)
        while batch.rows:
            steps += 1
            if steps == 3:
                host.detach(loadeds[0].adapter)
                other = engine.load(str(make_adapter(DEMO_DIR, tmp_path / "yan", seed=11)))
            for row in batch.step():
                out[rows.index(row)] = row.ids[0].tolist()
    assert [out[i] for i in range(3)] == expected
    assert batch._lanes[rows[0].slots[0]] != 1  # it moved
    host.detach(other.adapter)


def test_the_recorded_lanes_step_reads_no_tensor_data_on_the_host(served):
    """As test_stepgraphs' check of the base's step: the step and join bodies with rows of several
    adapters turn no tensor into a Python value (a CUDA graph could not record that)."""
    engine, loadeds = served
    batch = SlotBatch(loadeds[0].model, 4, graphs=False)
    requests = [
        Request(loaded, engine.build_input(TALKS[i], loaded)[0], FAST.generate_kwargs())
        for i, loaded in enumerate(loadeds)
    ]
    with torch.inference_mode():
        batch.join_all(requests)
        batch.step()  # every layer's stacks made (outside the fake mode: they are kept)
        with batch._lanes_of(loadeds) as (lanes, _version, _each):
            assert lanes is not None
            with faked(batch):
                batch._forward(4, (3,), 16, 32, lanes, True)
                batch._join_body(4, 32, lanes)
                assert batch.choice.shape == (4,)


def test_on_a_cpu_the_step_loop_takes_adapters_chats_either_way(served):
    """``adapters_in_slots`` is about the GPU's slots (its test: the recorded lanes steps below); on
    a CPU the step loop serves plain adapters' chats with or without it."""
    engine, loadeds = served
    stepper = StepBatcher()
    kwargs = FAST.generate_kwargs()
    assert stepper.takes(loadeds[0], kwargs)  # on a CPU: always
    stepper.adapters_in_slots = True
    assert stepper.takes(loadeds[0], kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorded_lanes_steps_give_the_eager_steps_tokens(tmp_path):
    """On a GPU, with ``adapters_in_slots``: chats of three adapters and the base in recorded steps
    reply as the same steps run eagerly, and an adapter attached meanwhile has its steps recorded
    anew (the host's version)."""
    base = load_checkpoint(str(DEMO_DIR), optimize="none")
    base.model.cuda()
    engine = ChatEngine(base, "test", batcher=Batcher())
    for seed, (name, r, targets) in enumerate(ADAPTERS):
        kwargs = {"targets": targets} if targets else {}
        engine.load(str(make_adapter(DEMO_DIR, tmp_path / name, seed=seed, r=r, **kwargs)))
    loadeds = [engine.model_for(name) for name, _, _ in ADAPTERS] + [engine.model_for("demo-model")]
    requests = []
    for i in range(12):
        loaded = loadeds[i % len(loadeds)]
        requests.append((loaded, engine.build_input(TALKS[i % len(TALKS)], loaded)[0], FAST.generate_kwargs()))

    def run(graphs: bool):
        stepper = StepBatcher(max_batch=8)
        stepper.adapters_in_slots = True
        stepper.cuda_graphs = "capture" if graphs else "off"
        replies = [f.result(120)[0].tolist() for f in [stepper.submit(*r) for r in requests]]
        from chat import stepgraphs

        return replies, stepgraphs.for_model(base.model, 8, graphs)

    (eager, _), (recorded, batch) = run(False), run(True)
    assert eager == recorded and batch.replays > 0 and any(key[-1] is not None for key in batch._graphs)
    before = dict(batch._graphs)
    engine.load(str(make_adapter(DEMO_DIR, tmp_path / "new", seed=7)))  # another lane: the stacks change
    (eager, _), (recorded, batch) = run(False), run(True)
    assert eager == recorded
    assert not any(key in before for key in batch._graphs if key[-1] is not None)  # recorded anew
