"""Beam search in the step loop (``chat.stepping``): a request's ``num_beams`` hypotheses are rows of
the running batch, beside other requests' rows, and after each step transformers' own beam-search
steps choose its next tokens and which hypotheses go on.

``generate()`` alone runs its beam search (``GenerationMixin._beam_search``) as calls of a few
helpers over the whole batch's scores; here the same helpers are called in the same order for a
batch of one, over this request's rows of the step's logits, so the reply is the one generate()
gives the request alone (tests/chat/test_stepping.py: token for token on the demo model, fp32 and
int8, joining a running batch mid-reply). What the step loop needs of a member of its batch:
``width`` rows, ``length`` self-attention columns, ``source`` encoder positions, ``last()`` the
tokens to feed next, ``choose(logits)`` (True when done), ``order`` (the rows' new order: each
hypothesis that goes on reads its parent's cache) and ``ids`` (the reply).

Private transformers helpers used (pinned by those tests): ``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``, ``_check_early_stop_heuristic``,
``_beam_search_has_unfinished_sequences``.
"""

from __future__ import annotations

import torch

from chat.fastgen import run_processors

PROMPT = 1  # the decoder's prompt: its start token


class BeamRows:
    """One beam-search request's hypotheses: transformers' ``_beam_search`` state for a batch of one."""

    plain = None  # not a greedy row (chat.rows.choose_plain)

    def __init__(self, request, model, start_id: int, processors, stop, config):
        self.request, self.model = request, model
        self.processors, self.stop = processors, stop
        k = self.width = config.num_beams
        self.early_stopping, self.length_penalty = config.early_stopping, config.length_penalty
        self.max_length = config.max_length
        self.length = 0  # self-attention columns each hypothesis has
        self.source = len(request.source)
        self.order: torch.Tensor | None = None
        pad, eos = config._pad_token_tensor, config._eos_token_tensor
        fill = pad or eos[0] if eos is not None else -1  # generate()'s own choice, precedence and all
        self.keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * k  # continuations kept a step
        self.top = torch.arange(self.keep) < k
        self.cur_len = PROMPT
        self.running = torch.full((1, k, self.max_length), int(fill), dtype=torch.int64)
        self.running[:, :, 0] = start_id
        self.sequences = self.running.clone()  # the finished hypotheses, best first
        self.running_scores = torch.zeros((1, k))
        self.running_scores[:, 1:] = -1e9  # the first step extends one hypothesis, not k copies of it
        self.scores = torch.full((1, k), -1e9)
        self.finished = torch.zeros((1, k), dtype=torch.bool)
        self.improvable = torch.ones((1, 1), dtype=torch.bool)
        self.running_indices = torch.full((1, k, self.max_length - PROMPT), -1, dtype=torch.int32)
        self.indices = self.running_indices.clone()

    @property
    def fed(self) -> int:
        """Ids each hypothesis has fed the decoder once its next step runs."""
        return self.cur_len

    def last(self) -> torch.Tensor:
        """Each hypothesis's newest token (k, 1)."""
        return self.running[0, :, self.cur_len - 1 : self.cur_len]

    def choose(self, logits: torch.Tensor) -> bool:
        """One step of ``_beam_search`` (its comments' b. to g.) on this request's logits (k, vocab)."""
        model, k, cur = self.model, self.width, self.cur_len
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = run_processors(self.processors, self.running[0, :, :cur], log_probs)
        log_probs = (log_probs[None] + self.running_scores[:, :, None]).reshape(1, -1)
        topk_log_probs, topk_sequences, topk_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs,
            running_sequences=self.running,
            running_beam_indices=self.running_indices,
            cur_len=cur,
            decoder_prompt_len=PROMPT,
            do_sample=False,
            beams_to_keep=self.keep,
            num_beams=k,
            vocab_size=logits.shape[-1],  # transformers before 5.24 asks for it; later ones ignore it
            batch_size=1,
        )
        hits = self.stop(topk_sequences[0, :, : cur + 1], None)[None]
        self.running, self.running_scores, self.running_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs,
            topk_running_sequences=topk_sequences,
            topk_running_beam_indices=topk_indices,
            next_token_hits_stopping_criteria=hits,
            num_beams=k,
        )
        self.sequences, self.scores, self.indices, self.finished = model._update_finished_beams(
            sequences=self.sequences,
            topk_running_sequences=topk_sequences,
            beam_scores=self.scores,
            topk_log_probs=topk_log_probs,
            beam_indices=self.indices,
            topk_running_beam_indices=topk_indices,
            is_early_stop_heuristic_unsatisfied=self.improvable,
            is_sent_finished=self.finished,
            next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=self.top,
            num_beams=k,
            cur_len=cur,
            decoder_prompt_len=PROMPT,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
        self.order = self.running_indices[0, :, cur - PROMPT].long()  # generate()'s cache reorder
        self.cur_len = cur = cur + 1
        self.improvable = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.improvable,
            running_beam_scores=self.running_scores,
            beam_scores=self.scores,
            is_sent_finished=self.finished,
            cur_len=cur,
            max_length=self.max_length,
            decoder_prompt_len=PROMPT,
            early_stopping=self.early_stopping,
            length_penalty=self.length_penalty,
        )
        going_on = model._beam_search_has_unfinished_sequences(
            self.improvable, self.finished, hits, self.early_stopping
        )
        return not bool(going_on)

    @property
    def ids(self) -> torch.Tensor:
        """The best hypothesis (1, length), cropped as generate() crops it."""
        generated = int((self.indices[:, 0] + 1).bool().sum(dim=1).max())
        return self.sequences[:, 0, : PROMPT + generated]


def reorder(cache: torch.Tensor, beams: list) -> None:
    """In slots (``chat.stepgraphs``): each beam search's hypotheses that go on read their parents'
    self-attention caches, as generate() reorders its cache: the slot of beam ``i`` takes a copy of
    the slot of beam ``order[i]``, for every beam search of a step and every layer at once (two
    calls). ``cache``: (keys and values, layers, slots, heads, columns, head size)."""
    pairs = [(slot, row.slots[parent]) for row in beams for slot, parent in zip(row.slots, row.order.tolist())]
    pairs = [(to, of) for to, of in pairs if to != of]
    if not pairs:
        return
    to, of = (torch.tensor(side, device=cache.device) for side in zip(*pairs))
    columns = max(row.cur_len for row in beams)  # the columns the hypotheses have (and one spare)
    kept = cache[..., :columns, :]
    kept.index_copy_(2, to, kept.index_select(2, of))
