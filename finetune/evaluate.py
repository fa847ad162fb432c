"""Evaluation: eval loss, generation with the seed's settings, sacreBLEU over all processes."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

import sacrebleu
import torch
from tqdm.auto import tqdm

from chat.fastgen import fast_kwargs, grouped_beams
from chat.model import load_model, load_tokenizer
from chat.prompt import KINDS, kind_of
from finetune.context_score import context_score, reply_scores
from finetune.packing import steady_attention

log = logging.getLogger(__name__)

# A source whose context no kind made (a Hub dataset not built by chat.prompt) is scored as this.
OTHER_KIND = "other"


def generation_kwargs(cfg) -> dict:
    """The seed's evaluation generation settings (each one a training flag)."""
    return dict(
        max_length=cfg.val_max_target_length,
        min_length=cfg.val_min_target_length,
        num_beams=cfg.num_beams,
        length_penalty=1.0,
        no_repeat_ngram_size=cfg.no_repeat_ngram_size,
        encoder_no_repeat_ngram_size=cfg.encoder_no_repeat_ngram_size,
        repetition_penalty=cfg.repetition_penalty,
        do_sample=False,
    )


@contextmanager
def decoding_attention(model, cfg):
    """Generation with ``cfg.eval_attention``, then back to the training kernels (the loss ran on
    those). Decoding one token at a time over short contexts is fastest with eager attention, and
    beam search with its grouped form (measured on H200, docs/benchmarks.md)."""
    if cfg.eval_attention == "grouped" and cfg.num_beams > 1:
        with grouped_beams(model, cfg.num_beams):
            yield
        return
    trained_with = model.config._attn_implementation
    wanted = "eager" if cfg.eval_attention == "grouped" else cfg.eval_attention
    if wanted != trained_with:
        model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        if wanted != trained_with:
            model.set_attn_implementation(trained_with)


def _decode(tokenizer, ids: torch.Tensor, keep_structure: bool = False) -> list[str]:
    """Token ids to text; ``keep_structure`` keeps the <s>/</s> turn markers (for prompts)."""
    pad = tokenizer.pad_token_id  # read once: a tokenizer attribute costs microseconds, x every token
    rows = [[t for t in row if t >= 0 and t != pad] for row in ids.tolist()]
    if keep_structure:
        rows = [row[:-1] if row and row[-1] == tokenizer.eos_token_id else row for row in rows]
    return [t.strip() for t in tokenizer.batch_decode(rows, skip_special_tokens=not keep_structure)]


@torch.no_grad()
def evaluate(
    accelerator, model, dataloader, tokenizer, cfg, zero3: bool = False, should_stop=None, context: bool = True
) -> dict | None:
    """Return eval_loss, eval_bleu, eval_seconds, (prompt, prediction, reference) samples,
    eval_bleu_<kind> / eval_rows_<kind> for each kind of dialogue present (``bleu_by_kind``) and
    the context score of the generated replies (``context_figures``: eval_context_*).

    ``should_stop`` (a callable) is polled before each batch, collectively so all ranks agree;
    when it says stop, evaluation ends early and returns None. ``context``: False skips the context score.
    """
    model.eval()
    start = time.perf_counter()
    generator = accelerator.unwrap_model(model)
    kwargs = generation_kwargs(cfg)
    pad = tokenizer.pad_token_id
    predictions, references, sources, kinds, samples, losses = [], [], [], [], [], []
    # A bar on a terminal only: in a log file (the app's train.log) its redraws would be noise.
    bar = accelerator.is_local_main_process and sys.stderr.isatty()
    for step, batch in enumerate(tqdm(dataloader, desc="evaluating", disable=not bar)):
        if should_stop is not None:
            flag = accelerator.reduce(torch.tensor([float(should_stop())], device=accelerator.device), "max")
            if flag.item() > 0:
                model.train()
                return None
        gen_kwargs = fast_kwargs(kwargs, batch["input_ids"]) if cfg.fast_ngram_blocking else kwargs
        with steady_attention(batch["input_ids"].is_cuda):  # an evaluation batch is a new shape
            loss = model(**batch).loss.detach().float()
            with decoding_attention(generator, cfg):
                # ZeRO-3 shards the weights: every rank must take part in every generation step.
                generated = generator.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    synced_gpus=zero3,
                    **gen_kwargs,
                )
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=pad)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        inputs = accelerator.pad_across_processes(batch["input_ids"], dim=1, pad_index=pad)
        # gather_for_metrics drops the duplicates padding the last uneven batch.
        generated, labels, inputs = accelerator.gather_for_metrics((generated, labels, inputs))
        preds, refs = _decode(tokenizer, generated), _decode(tokenizer, labels)
        predictions += preds
        references += refs
        prompts = _decode(tokenizer, inputs, keep_structure=True)  # (cheap next to generating)
        sources += [without_prefix(prompt, cfg.source_prefix) for prompt in prompts]
        kinds += [source_kind(prompt, cfg.source_prefix) for prompt in prompts]
        if step < cfg.n_val_batch_generations:
            samples += [dict(prompt=p, prediction=y, reference=r) for p, y, r in zip(prompts, preds, refs)]
    bleu = sacrebleu.corpus_bleu(predictions, [references]).score
    context = (
        context_figures(accelerator, generator, tokenizer, sources, predictions, references, cfg) if context else {}
    )
    model.train()
    return dict(
        eval_bleu=bleu,
        eval_loss=torch.cat(losses).mean().item() if losses else float("nan"),
        eval_samples=len(predictions),
        eval_seconds=time.perf_counter() - start,
        samples=samples,
        **bleu_by_kind(predictions, references, kinds, whole=bleu),
        **context,
    )


def without_prefix(prompt: str, source_prefix: str) -> str:
    """The source of a decoded encoder input (prefix + source; decoding may lose edge spaces)."""
    text, prefix = prompt.strip(), source_prefix.strip()
    if prefix and text.startswith(prefix):
        text = text[len(prefix) :].lstrip()
    return text


def source_kind(prompt: str, source_prefix: str) -> str:
    """The kind of a decoded encoder input (prefix + source)."""
    try:
        return kind_of(without_prefix(prompt, source_prefix))
    except ValueError:
        return OTHER_KIND


_SCORERS: dict[str, tuple] = {}  # --context_scorer name -> (model, tokenizer), loaded once per process


def _scorer(cfg, generator, tokenizer, device) -> tuple:
    """The context score's model and tokenizer: ``--context_scorer``'s (in eval mode, on ``device``)
    or the evaluated model's own."""
    name = getattr(cfg, "context_scorer", None)
    if not name:
        return generator, tokenizer
    if name not in _SCORERS:
        dtype = next(generator.parameters()).dtype  # the evaluated model's (bf16 on GPUs)
        _SCORERS[name] = (load_model(name).to(device=device, dtype=dtype).eval(), load_tokenizer(name))
    return _SCORERS[name]


def context_figures(accelerator, generator, tokenizer, sources, predictions, references, cfg) -> dict:
    """``context_score.context_score`` of the generated replies (and of the references, its
    ceiling) with eval_context_seconds, its share of the evaluation's time. Every process holds
    every row (gathered for BLEU); each scores an equal slice of the (row, candidate) pairs, so
    ZeRO-3's sharded forwards line up, and the scores are gathered back. {} without contexts."""
    start = time.perf_counter()
    model, scorer_tokenizer = _scorer(cfg, generator, tokenizer, accelerator.device)
    world, rank = accelerator.num_processes, accelerator.process_index
    batch = max(64, cfg.per_device_eval_batch_size)  # one forward, no generation: the eval batch fits

    def score(flat_sources: list[str], flat_replies: list[str]) -> list[float]:
        n = len(flat_sources)
        if n == 0:
            return []
        per = -(-n // world)  # every process scores the same number of pairs (the last ones padded)
        mine = list(range(rank * per, (rank + 1) * per))
        picked = [i if i < n else 0 for i in mine]
        own = reply_scores(
            model,
            scorer_tokenizer,
            [flat_sources[i] for i in picked],
            [flat_replies[i] for i in picked],
            cfg,
            batch_size=batch,
        )
        if world == 1:
            return own[:n]
        gathered = accelerator.gather(torch.tensor(own, device=accelerator.device, dtype=torch.float32))
        return gathered.cpu().tolist()[:n]

    if not sources:
        return {}
    figures = context_score(model, scorer_tokenizer, sources, predictions, references, cfg, score=score)
    if figures:
        figures["eval_context_seconds"] = time.perf_counter() - start
    return figures


def bleu_by_kind(predictions: list[str], references: list[str], kinds: list[str], whole: float | None = None) -> dict:
    """eval_bleu_<kind> (corpus BLEU of that kind's rows) and eval_rows_<kind>, for each kind present.
    ``whole``, the corpus BLEU of all rows when known, is reused for a kind that has every row
    (sacreBLEU over 1,000 rows is ~0.4 s of CPU)."""
    out = {}
    for kind in (*KINDS, OTHER_KIND):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if whole is not None and len(rows) == len(kinds):
            out[f"eval_bleu_{kind}"], out[f"eval_rows_{kind}"] = whole, len(rows)
        elif rows:
            preds, refs = [predictions[i] for i in rows], [references[i] for i in rows]
            out[f"eval_bleu_{kind}"] = sacrebleu.corpus_bleu(preds, [refs]).score
            out[f"eval_rows_{kind}"] = len(rows)
    return out


def evaluate_all(accelerator, model, loaders, tokenizer, cfg, zero3=False, should_stop=None) -> dict | None:
    """``evaluate`` on the validation split and, when there is one, the held-out feedback split,
    with the same generation settings. ``loaders`` = (validation, held-out feedback or None); the
    latter's figures come as eval_bleu_feedback, eval_loss_feedback and eval_rows_feedback beside
    the validation split's. None when stopped."""
    dataloader, feedback_dl = loaders
    results = evaluate(accelerator, model, dataloader, tokenizer, cfg, zero3=zero3, should_stop=should_stop)
    if results is None or feedback_dl is None:
        return results
    held = evaluate(accelerator, model, feedback_dl, tokenizer, cfg, zero3, should_stop, context=False)
    if held is None:
        return None
    results.update(
        eval_bleu_feedback=held["eval_bleu"],
        eval_loss_feedback=held["eval_loss"],
        eval_rows_feedback=held["eval_samples"],
        eval_seconds=results["eval_seconds"] + held["eval_seconds"],
    )
    return results


def scores(results: dict) -> dict:
    """The figures of an evaluation beyond eval_bleu / eval_loss: per kind, held-out feedback, the
    context score and held-out preference rows (eval_pref_*: finetune.preference_train): the keys
    metrics.jsonl, all_results.json, the trackers and the model card carry beside eval_bleu."""
    prefixes = ("eval_bleu_", "eval_rows_", "eval_loss_", "eval_context_", "eval_pref_")
    return {k: v for k, v in results.items() if k.startswith(prefixes)}
