"""A request's rows in the step loop (``chat.stepping``): its generate() kwargs made into
transformers' own logits processors and stopping criteria, as generate() alone builds them, and the
row that applies them to its logits each step (``Row``; a beam search is ``chat.beams.BeamRows``).
Greedy rows whose processors ``chat.greedy`` knows as numbers (``Row.plain``) take their tokens from
one pass over all such rows instead (``choose_plain``: the same choices).

Private transformers helpers used (pinned by tests/chat/test_stepping.py): ``_prepare_generation_config``,
``_prepare_special_tokens``, ``_prepare_generated_length``, ``_get_logits_processor``,
``_get_stopping_criteria``.
"""

from __future__ import annotations

import weakref

import torch
from transformers import (
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from chat.batching import Request, hand_ids
from chat.beams import BeamRows
from chat.fastgen import CACHE_KWARG, NoRepeatNGram, fast_kwargs, run_processors
from chat.greedy import choose_greedy, plain_settings


class Row:
    """One request in the running batch: its settings as transformers' processors, its ids so far.
    (A beam-search request is ``chat.beams.BeamRows``: the same members, ``width`` rows.)"""

    width = 1  # rows of the batch
    order = None  # rows reordered after a step (beam search's)

    def __init__(self, request: Request, model, start_id: int):
        self.request = request
        seed = request.kwargs.get("generator_seed")
        self.processors, self.stop, config = settings(model, request)
        self.sample = bool(config.do_sample)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(int(seed))
        self.ids = torch.tensor([[start_id]])
        self.length = 0  # self-attention columns this row has
        self.source = len(request.source)
        # Greedy settings chat.greedy processes for all rows at once (None: this row's own processors).
        self.plain = plain_of(self, eos_of(model))
        if request.streamer is not None:
            hand_ids(request.streamer, [start_id])

    @property
    def fed(self) -> int:
        """Ids fed to the decoder once its next step runs (the self-attention columns it reads)."""
        return self.ids.shape[1]

    def last(self) -> torch.Tensor:
        return self.ids[:, -1:]

    def choose(self, logits: torch.Tensor) -> bool:
        """Take the next token from this row's logits (1, vocab); True when the row is done."""
        scores = run_processors(self.processors, self.ids, logits)
        if self.sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator)
        else:
            token = torch.argmax(scores, dim=-1, keepdim=True)
        self.ids = torch.cat([self.ids, token], dim=1)
        if self.request.streamer is not None:
            hand_ids(self.request.streamer, token[0].tolist())
        return bool(self.stop(self.ids, scores).all())

    def take(self, token: int, eos: set[int]) -> bool:
        """Take ``token``, chosen for this plain row by ``choose_plain``; True when the row is done
        (its stopping criteria, as numbers: EOS or the longest reply)."""
        self.ids = torch.cat([self.ids, torch.tensor([[token]])], dim=1)
        if self.request.streamer is not None:
            hand_ids(self.request.streamer, [token])
        return token in eos or self.ids.shape[1] >= self.plain["max_length"]


def eos_of(model) -> set[int]:
    """The model's EOS ids (its generation config's)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def eos_mask(eos: set[int], vocab: int, device=None) -> torch.Tensor:
    """(vocab,) True at the EOS ids: ``choose_plain``'s (``chat.greedy.choose_greedy``'s) mask."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[list(eos)] = True
    return mask


_PLAIN: dict = {}  # plain_of's answers: (processors, stop, sample, eos) ids -> (processors, stop, answer)


def plain_of(row, eos: set[int]) -> dict | None:
    """``chat.greedy.plain_settings`` of the row, once per set of processors (rows of the same
    settings share theirs: ``settings``)."""
    key = (id(row.processors), id(row.stop), row.sample, frozenset(eos))
    known = _PLAIN.get(key)
    if known is None:
        if len(_PLAIN) >= 64:
            _PLAIN.clear()
        known = _PLAIN[key] = (row.processors, row.stop, plain_settings(row, eos))  # kept: the ids stay theirs
    return known[2]


def choose_plain(rows: list[Row], logits: torch.Tensor, eos_mask: torch.Tensor) -> list[int]:
    """The next token of each plain greedy row (``Row.plain``) from its logits (rows, vocab), all
    rows in one pass of tensor operations (``chat.greedy.choose_greedy``: what each row's own
    processors pick, ~0.2 ms for 8 rows on a CPU where the rows' own cost ~2 ms)."""
    vocab = logits.shape[1]
    settings = [row.plain for row in rows]
    numbers = torch.tensor(
        [[s["eos_until"], s["forced_at"], s["ngram"], row.ids.shape[1]] for s, row in zip(settings, rows)]
    )
    eos_until, forced_at, ngram, length = numbers.unbind(1)
    penalty = torch.tensor([s["penalty"] for s in settings])
    sizes = tuple(sorted({s["ngram"] for s in settings if s["ngram"]}))
    ids = torch.nn.utils.rnn.pad_sequence([row.ids[0] for row in rows], batch_first=True, padding_value=vocab)
    width = max((ids.shape[1], *sizes))  # an n-gram's width at least: choose_greedy unfolds the ids
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=vocab)
    return choose_greedy(logits, ids, length, penalty, eos_until, forced_at, ngram, sizes, eos_mask).tolist()


# Processors and criteria that keep no state between calls: one list serves every row of the same
# settings (building them takes transformers ~1 ms a request, in the worker every row waits on).
SHARED = (
    RepetitionPenaltyLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    NoRepeatNGram,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MaxLengthCriteria,
    EosTokenCriteria,
)
BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings: built}


def beams_of(kwargs: dict) -> int:
    """The beams a request's generate() kwargs ask for: its rows in a step (no ``num_beams``: 1)."""
    return int(kwargs.get("num_beams") or 1)


def member(request: Request, model, start_id: int) -> Row | BeamRows:
    """A joining request's member of the batch: one row, or its beams' rows."""
    if beams_of(request.kwargs) == 1:
        return Row(request, model, start_id)
    return BeamRows(request, model, start_id, *settings(model, request))


def settings(model, request: Request) -> tuple:
    """A request's logits processors, stopping criteria and generation config (its sampling, beams,
    lengths), as transformers' generate() builds them from its kwargs; reused for later requests of
    the same settings."""
    key = tuple(sorted((k, v) for k, v in request.kwargs.items() if k != "generator_seed"))
    try:
        known = BUILT.setdefault(model, {})
        if key in known:
            return known[key]
    except TypeError:  # an unhashable value (a custom processor list): built for this row alone
        known = None
    kwargs = fast_kwargs(dict(request.kwargs), request.encoded["input_ids"])
    kwargs.pop("generator_seed", None)
    custom = kwargs.pop("logits_processor", None)
    kwargs.pop(CACHE_KWARG, None)  # fast_kwargs' cache for generate()'s beam search: the loop has its own
    config, _ = model._prepare_generation_config(None, **kwargs)
    config.num_beams = beams_of(kwargs)
    model._prepare_special_tokens(config, True, device="cpu", batch_size=1)
    source = request.encoded["input_ids"]
    config = model._prepare_generated_length(config, True, True, "input_ids", 1, source)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=1,
        encoder_input_ids=source,
        logits_processor=custom,
        device="cpu",
        model_kwargs={},
    )
    stop = model._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    built = (processors, stop, config)
    if known is not None and all(type(x) in SHARED for x in [*processors, *stop]):
        if len(known) >= 64:
            known.clear()
        known[key] = built
    return built
