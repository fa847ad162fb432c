"""chat/stepgraphs.py: the step loop in slots. The batched greedy pass picks what each row's own
processors pick; the slot loop's replies are generate()'s alone (test_stepping's tests, run again
here with slots on the CPU); the step a graph records reads no tensor data on the host; on a GPU the
steps replay and give the eager steps' tokens."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import test_stepping
import torch
from test_stepping import FAST, TALKS, demo, inputs, static  # noqa: F401 - fixtures for the tests run again
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import (
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from chat.batching import Batcher, Request
from chat.engine import DEMO_DIR, ChatEngine, load_checkpoint
from chat.fastgen import EncoderNoRepeatNGram, NoRepeatNGram
from chat.greedy import UNPROCESSED, choose_greedy, plain_settings
from chat.rows import Row
from chat.stepgraphs import SlotBatch, stage
from chat.stepping import StepBatcher

EOS = 2


def _row_processors(penalty, min_length, min_new, max_length, n):
    """One row's processors as transformers' generate() orders them (and chat.fastgen's n-gram rule)."""
    eos = torch.tensor([EOS])
    out = LogitsProcessorList()
    if penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty))
    if min_length:
        out.append(MinLengthLogitsProcessor(min_length, eos))
    if min_new:
        out.append(MinNewTokensLengthLogitsProcessor(1, min_new, eos))
    out.append(ForcedEOSTokenLogitsProcessor(max_length, eos))
    if n:
        out.append(NoRepeatNGram(n))
    return out


def test_the_batched_greedy_pass_picks_what_each_rows_own_processors_pick():
    """Random rows over a 12-token vocabulary (so n-grams repeat and bans bite), each with its own
    length and settings, many times: the batched pick equals each row's own processors' argmax."""
    rng = random.Random(0)
    vocab, columns, checked = 12, 16, 0
    for trial in range(200):
        rows = rng.randint(1, 6)
        settings, seqs = [], []
        for _ in range(rows):
            length = rng.randint(1, columns - 1)
            seqs.append([1] + [rng.choice([0, 3, 4, 5, 6, 7]) for _ in range(length - 1)])  # no EOS inside
            settings.append(
                dict(
                    penalty=rng.choice([1.0, 1.2, 0.7]),
                    min_length=rng.choice([0, 5]),
                    min_new=rng.choice([0, 8]),
                    max_length=rng.choice([length + 1, columns]),
                    n=rng.choice([0, 2, 3]),
                )
            )
        logits = torch.randn(rows, vocab) * 3
        logits[:, EOS] += 2  # EOS often wins unless banned
        want = []
        for k in range(rows):
            ids = torch.tensor([seqs[k]])
            scores = _row_processors(**settings[k])(ids, logits[k : k + 1].clone())
            want.append(int(scores.argmax(-1)))
        ids = torch.full((rows, columns), vocab)
        for k, seq in enumerate(seqs):
            ids[k, : len(seq)] = torch.tensor(seq)
        s = settings
        got = choose_greedy(
            logits,
            ids,
            torch.tensor([len(q) for q in seqs]),
            torch.tensor([x["penalty"] for x in s]),
            torch.tensor([max(x["min_length"], 1 + x["min_new"] if x["min_new"] else 0) for x in s]),
            torch.tensor([x["max_length"] - 1 for x in s]),
            torch.tensor([x["n"] for x in s]),
            tuple(sorted({x["n"] for x in s if x["n"]})),
            torch.arange(vocab) == EOS,
        ).tolist()
        assert got == want, f"trial {trial}: {settings} {seqs}"
        checked += rows
    assert checked > 500


def _row(loaded, engine, settings, talk=0):
    encoded, _ = engine.build_input(TALKS[talk])
    kwargs = settings.generate_kwargs()
    if settings.seed is not None:
        kwargs["generator_seed"] = settings.seed
    return Row(Request(loaded, encoded, kwargs), loaded.model, 1)


def test_which_rows_take_the_batched_pass(demo):  # noqa: F811
    engine = ChatEngine(demo, "test", batcher=Batcher())
    plain = plain_settings(_row(demo, engine, FAST), {EOS})
    assert plain == {"penalty": 1.2, "eos_until": 1, "forced_at": 40, "ngram": 3, "max_length": 41}
    longer = plain_settings(_row(demo, engine, replace(FAST, min_new_tokens=12)), {EOS})
    assert longer["eos_until"] == 13  # 12 new tokens after the decoder's start token
    sampled = replace(FAST, do_sample=True, temperature=0.9, top_p=0.8, seed=3)
    assert plain_settings(_row(demo, engine, sampled), {EOS}) is None  # its own generator
    encoder_rule = _row(demo, engine, replace(FAST, encoder_no_repeat_ngram_size=2))
    assert any(isinstance(p, EncoderNoRepeatNGram) for p in encoder_rule.processors)
    assert plain_settings(encoder_rule, {EOS}) is None
    assert plain_settings(_row(demo, engine, FAST), {EOS, 7}) is None  # another EOS set


@pytest.fixture
def slots(monkeypatch):
    monkeypatch.setattr(StepBatcher, "slots", True)


# test_stepping's end-to-end tests again, in slots (each reply token for token generate()'s alone).
@pytest.mark.usefixtures("slots")
class TestInSlots:
    test_join_and_leave = staticmethod(
        test_stepping.test_requests_join_a_running_batch_and_leave_it_with_their_own_replies
    )
    test_streams = staticmethod(test_stepping.test_concurrent_streams_are_kept_apart_through_the_engine)
    test_seeded = staticmethod(test_stepping.test_a_seeded_sample_is_the_same_beside_any_neighbours)
    test_adapters = staticmethod(test_stepping.test_rows_of_different_adapters_share_steps_each_through_its_own)
    test_text_streamer = staticmethod(test_stepping.test_a_text_streamer_reads_the_steps_as_it_reads_generate)
    test_adapters_beams = staticmethod(
        test_stepping.test_a_beam_search_of_one_adapter_shares_steps_with_another_adapters_rows
    )

    def test_beams(self, demo, static):  # noqa: F811 - a slot per beam, reordered by copies
        test_stepping.test_beam_searches_share_steps_with_other_rows_and_reply_as_generate_alone("none", demo, static)


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setattr(StepBatcher, "slots", True)
    monkeypatch.setattr(StepBatcher, "lookahead", True)


# And with the next step started before each step's tokens are handed out (a GPU's default, where
# steps are replayed graphs; the same order of work on the CPU, minus the overlap).
@pytest.mark.usefixtures("ahead")
class TestInSlotsAhead(TestInSlots):
    pass


def _run_with_joins(demo, requests, ahead: bool):  # noqa: F811
    """Step a SlotBatch by hand, letting requests 1, 3 and 2 join at steps 2, 4 and 9: each reply,
    each stream's ids, and at each put (a step was started, a sampling row was running)."""
    batch = SlotBatch(demo.model, 4, graphs=False)
    puts = []

    class Recorder(test_stepping.Tokens):
        def put(self, value):
            puts.append((batch._flight is not None, any(row.plain is None for row in batch.rows)))
            super().put(value)

    streamers = [Recorder() for _ in requests]
    submitted = [Request(demo, *r, s) for r, s in zip(requests, streamers)]
    joins = {0: [submitted[0]], 2: [submitted[1]], 4: [submitted[3]], 9: [submitted[2]]}
    out, step = {}, 0
    with torch.inference_mode():
        batch.join_all(joins.pop(0))
        while batch.rows:
            step += 1
            for row in batch.step(between=lambda k=step: batch.join_all(joins.pop(k, [])), ahead=ahead):
                out[next(i for i, r in enumerate(submitted) if r is row.request)] = row.ids[0].tolist()
    assert not joins and batch._flight is None
    return [out[i] for i in range(len(requests))], [s.ids for s in streamers], puts


def test_the_next_step_starts_before_the_tokens_are_handed_out(demo, static):  # noqa: F811
    """``step(ahead=True)``: joiners are let in once a step's tokens are known, the next step is
    started, then the tokens reach the streamers; while a row samples (its token chosen on the host)
    steps go one at a time. Each reply is generate()'s alone either way."""
    engine = ChatEngine(demo, "test", batcher=static)
    requests = [inputs(engine, i) for i in range(4)]  # 0-2 greedy, 3 samples
    expected = [test_stepping.alone(static, demo, *r) for r in requests]
    for ahead in (True, False):
        replies, streamed, puts = _run_with_joins(demo, requests, ahead)
        assert replies == expected and streamed == expected
        assert not any(started for started, sampling in puts if sampling)
        if ahead:  # all greedy: every put but each row's start token and the very last behind the next step
            late = [started for started, sampling in puts if not sampling]
            assert late.count(False) <= len(requests) + 1 and late.count(True) > 10
        else:
            assert not any(started for started, _ in puts)


def test_a_failed_step_fails_its_rows_and_the_worker_goes_on(demo, static, monkeypatch):  # noqa: F811
    """A step that raises fails the requests in it; the slots are emptied (their tensors are
    inference tensors: the worker must not die doing it) and the next request is served."""
    engine = ChatEngine(demo, "test", batcher=static)
    monkeypatch.setattr(StepBatcher, "slots", True)
    stepper = StepBatcher()
    body, calls = SlotBatch._forward, []

    def first_fails(self, *args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the device fell over")
        return body(self, *args)

    monkeypatch.setattr(SlotBatch, "_forward", first_fails)
    with pytest.raises(RuntimeError, match="fell over"):
        stepper.submit(demo, *inputs(engine, 0)).result(60)
    assert stepper.submit(demo, *inputs(engine, 0)).result(60)[0].tolist() == test_stepping.alone(
        static, demo, *inputs(engine, 0)
    )


def test_a_failed_join_leaves_its_slots_free(demo, static, monkeypatch):  # noqa: F811
    """Requests of two models (here two handles of one) join in two groups; the second group's join
    fails: no slot is taken or left active (an active free slot would step on), and the next join
    and its replies are as if nothing happened."""
    engine = ChatEngine(demo, "test", batcher=static)
    requests = [inputs(engine, i) for i in range(3)]
    batch = SlotBatch(demo.model, 4, graphs=False)
    body, calls = SlotBatch._join_body, []

    def second_fails(self, n, width, lanes=None):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("no memory for this join")
        return body(self, n, width, lanes)

    monkeypatch.setattr(SlotBatch, "_join_body", second_fails)
    other = copy.copy(demo)  # another handle: its requests encode as a group of their own
    with torch.inference_mode(), pytest.raises(RuntimeError, match="no memory"):
        batch.join_all([Request(demo, *requests[0]), Request(other, *requests[1])])
    assert calls == [1, 1] and not batch.rows and not batch.active.any()
    with torch.inference_mode():
        joined = [Request(demo, *r) for r in requests]
        batch.join_all(joined)
        out = {}
        while batch.rows:
            out.update({id(row.request): row.ids[0].tolist() for row in batch.step()})
    assert [out[id(r)] for r in joined] == [test_stepping.alone(static, demo, *r) for r in requests]


def test_a_joins_staged_rows_are_each_source_its_mask_and_its_settings_then_padding():
    fast = {"penalty": 1.5, "eos_until": 2, "forced_at": 9, "ngram": 3}
    joiners = [([7, 8], 0, fast, 1), ([5, 6, 7, 9], 3, UNPROCESSED, 0)]  # the second fills its slot's 4 positions
    staged, penalty = stage(joiners, n=4, sources=4, pad=1, spare=8)
    assert staged.dtype == torch.long and penalty.dtype == torch.float32
    assert staged.tolist() == [
        [7, 8, 1, 1, 1, 1, 0, 0, 0, 2, 9, 3, 1],  # ids padded, mask, slot, eos_until, forced_at, ngram, lane
        [5, 6, 7, 9, 1, 1, 1, 1, 3, 0, -1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 8, 0, -1, 0, 0],  # padding rows: one token seen, into the spare slot
        [1, 1, 1, 1, 1, 0, 0, 0, 8, 0, -1, 0, 0],
    ]
    assert penalty.tolist() == [1.5, 1.0, 1.0, 1.0]


def test_a_slot_holds_the_decoders_positions_and_no_more(demo, slots):  # noqa: F811
    stepper = StepBatcher()
    assert stepper.takes(demo, FAST.generate_kwargs())
    positions = demo.model.config.max_position_embeddings
    assert not stepper.takes(demo, replace(FAST, max_new_tokens=positions).generate_kwargs())  # to the static batcher
    engine = ChatEngine(demo, "test", batcher=stepper)
    assert engine.reply(TALKS[0], "ok", replace(FAST, max_new_tokens=positions))[0]
    assert stepper.steps == 0


def test_slots_are_reused_and_kept_between_bursts(demo, static):  # noqa: F811
    engine = ChatEngine(demo, "test", batcher=static)
    stepper = StepBatcher(max_batch=2)
    stepper.slots = True
    for _burst in range(2):
        requests = [inputs(engine, i) for i in range(5)]
        futures = [stepper.submit(demo, *r) for r in requests]
        assert [f.result(60)[0].tolist() for f in futures] == [test_stepping.alone(static, demo, *r) for r in requests]
    from chat import stepgraphs

    batch = stepgraphs.for_model(demo.model, 2)
    assert batch.capacity == 2 and not batch.rows and stepper.widest == 2


def faked(batch: SlotBatch) -> FakeTensorMode:
    """Every tensor of ``batch`` made fake (its values unknown); the mode to run its bodies in."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, fake.from_tensor(value))
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            setattr(batch, name, [fake.from_tensor(t) for t in value])
    return fake


def test_the_recorded_step_reads_no_tensor_data_on_the_host(demo, static):  # noqa: F811
    """What a CUDA graph records must not turn a tensor into a Python value (``.item()``, a shape
    from data, ``if tensor``): under fake tensors that raises. The slots' step and join bodies run
    that way here on the CPU, with every tensor they read fake."""
    engine = ChatEngine(demo, "test", batcher=static)
    batch = SlotBatch(demo.model, 4, graphs=False)
    with torch.inference_mode():
        batch.join_all([Request(demo, *inputs(engine, i)) for i in range(3)])
        with faked(batch):
            batch._forward(4, (3,), 16, 32, None, True)  # a step, the rows advanced
            batch._join_body(4, 32)  # a join: the encoder, the slots set up
            assert batch.choice.shape == (4,)
            with pytest.raises(DataDependentOutputException):  # the check can fail: a host read
                batch.length.max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("beams", [False, True])
def test_graph_replays_give_the_eager_steps_tokens(beams):
    """Greedy and sampled rows; with ``beams`` beam searches too (a slot per beam, reordered by
    copies between replays) beside them."""
    loaded = load_checkpoint(str(DEMO_DIR), optimize="none")
    loaded.model.cuda()
    engine = ChatEngine(loaded, "test", batcher=Batcher())
    requests = [inputs(engine, i) for i in range(6 if beams else 12)]
    if beams:
        requests += [(r[0], s.generate_kwargs()) for r, s in zip(requests, test_stepping.MIXED)]
    width = 32 if beams else 8
    replies = {}
    for graphs in (False, True):
        stepper = StepBatcher(max_batch=width)
        stepper.beams, stepper.cuda_graphs = beams, "capture" if graphs else "off"
        futures = [stepper.submit(loaded, *r) for r in requests]
        replies[graphs] = [f.result(120)[0].tolist() for f in futures]
        from chat import stepgraphs

        batch = stepgraphs.for_model(loaded.model, width, graphs)
        assert (batch.replays > 0) == graphs and batch.graph_bytes >= 0
        if beams:
            assert stepper.widest > 10  # beams shared steps with other rows
    # The recorded steps run the eager steps' kernels: the same tokens. (Against generate() alone a
    # GPU's batched products round differently; the CPU tests above check that equality.)
    assert replies[True] == replies[False]


def test_a_beam_search_wider_than_the_slots_fails_at_once(demo):  # noqa: F811
    """Slots fewer than a request's beams (their memory budget cut them below ``gpu_max_batch``):
    the request fails with the reason instead of waiting for room that never comes."""
    engine = ChatEngine(demo, "test", batcher=Batcher())
    stepper = StepBatcher(max_batch=8)
    batch, held = SlotBatch(demo.model, 4, graphs=False), []
    wide = Request(demo, inputs(engine, 0)[0], {**FAST.generate_kwargs(), "num_beams": 6})
    narrow = Request(demo, *inputs(engine, 1))
    stepper._admit(batch, [wide, narrow], held)
    with pytest.raises(ValueError, match="6 beams: a step holds 4 rows"):
        wide.future.result(1)
    assert not held and [row.request for row in batch.rows] == [narrow]


def test_the_slots_fit_their_memory_budget(demo):  # noqa: F811
    """Rows beyond what three quarters of the budget holds are not made (the rest is for the graphs):
    a small GPU gets fewer slots instead of running out of memory."""
    from chat.stepgraphs import CPU_BUDGET_BYTES, default_budget

    per_row = SlotBatch(demo.model, 8, graphs=False).cache_bytes // 8
    assert SlotBatch(demo.model, 64, graphs=False, budget_bytes=per_row * 4 * 4 // 3 + 1).capacity == 4
    assert SlotBatch(demo.model, 64, graphs=False, budget_bytes=1).capacity == 1  # never none
    assert default_budget(torch.device("cpu")) == CPU_BUDGET_BYTES
