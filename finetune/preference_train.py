"""Preference tuning in the recipe (``--objective dpo|kto``): what ``finetune/train.py`` does
differently when the run learns from preference rows instead of target replies.

- ``load``: the rows of ``--preference_file`` (held-out ones from ``--preference_validation_file``,
  else every 10th) read, validated and tokenized before the accelerator exists, so a bad file
  fails like any other data file; the BLEU evaluation set still comes from ``--dataset_name`` /
  ``--validation_file``.
- ``Preferences.train_loader``: the train loader yields preference batches (not packed: each
  row's two replies share one source, ``finetune.preference.reply_logps``).
- ``Preferences.prepare``: right after ``accelerator.prepare``, before a checkpoint is restored,
  dropout is turned off (``disable_dropout``) and every row's reply log-probabilities under the
  model as it starts are computed once, sharded over the processes, and kept as the rows'
  reference columns (``ref_chosen``/``ref_rejected``, ``ref_logps``/``ref_kl``). The run needs no
  second copy of the model, a resumed run computes the same values from the same starting model,
  and for a fresh LoRA adapter (its B at zero) they are the base's, the adapter switched off.
- ``Preferences.loss``: ``finetune.preference.preference_loss`` on a batch.
- ``Preferences.evaluate``: on the held-out rows, ``eval_pref_accuracy`` (DPO: share of pairs
  where the model gives the chosen reply the higher log-probability; KTO: share of rows whose
  implicit reward has the label's sign), ``eval_pref_margin`` (the mean of that log-probability
  difference) and ``eval_pref_rows``.
- ``start_evaluation``: a fresh preference run evaluates once before its first step (an ``eval``
  event at step 0 with ``start: true``), so ``summary`` can say how far BLEU and the preference
  accuracy moved and flag a BLEU that fell more than ``BLEU_DROP_LIMIT`` points
  (``bleu_drop_flag``, a warning in the log and the model card).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from finetune.evaluate import evaluate_all, scores
from finetune.preference import BLEU_DROP_LIMIT, REFERENCE, PreferenceCollator, preference_loss, reply_logps
from finetune.preference_data import load_preferences, tokenize

log = logging.getLogger(__name__)

STATE_KEY = "preference_start"  # the start evaluation's figures, in a checkpoint's trainer_state.json


@dataclass
class WithReference:
    """A preference batch plus its rows' reference log-probabilities, looked up by the ``row``
    column in ``table`` (rows x 2, NaN until ``Preferences.prepare`` fills it: the loaders
    exist, and DeepSpeed reads the batch size off the train loader, before the model that
    computes them is prepared)."""

    collator: PreferenceCollator
    objective: str
    table: torch.Tensor

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = torch.tensor([f["row"] for f in features])
        batch = self.collator([{k: v for k, v in f.items() if k != "row"} for f in features])
        first, second = REFERENCE[self.objective]
        batch.update(row=rows, **{first: self.table[rows, 0], second: self.table[rows, 1]})
        return batch


def _numbered(rows: Dataset) -> Dataset:
    return rows.add_column("row", list(range(len(rows))))


@dataclass
class Preferences:
    """A preference run's rows, loaders and start figures (``Run.prefs``; None for ``--objective sft``)."""

    objective: str
    beta: float
    sft_weight: float
    train: Dataset  # tokenized, with a ``row`` column
    held: Dataset
    train_collator: WithReference
    held_collator: WithReference
    reference_dl: DataLoader | None = None  # the train rows in order, prepared (sharded)
    held_dl: DataLoader | None = None  # prepared; None without held-out rows
    start: dict = field(default_factory=dict)  # start_eval_bleu, start_eval_pref_accuracy, ...
    auto_batch: bool = False  # --per_device_train_batch_size auto: sized for SFT rows

    def train_loader(self, cfg, **loader_kwargs) -> DataLoader:
        """Shuffled preference batches, seeded. An 'auto' batch (finetune.memory sizes it for SFT
        rows) is halved: each row's forward runs two replies."""
        if self.auto_batch:
            cfg.per_device_train_batch_size = max(1, cfg.per_device_train_batch_size // 2)
            log.info(f"preference batches of {cfg.per_device_train_batch_size} rows ('auto' halved: two replies a row)")
        return DataLoader(
            self.train,
            batch_size=cfg.per_device_train_batch_size,
            shuffle=True,
            **{**loader_kwargs, "collate_fn": self.train_collator},
            generator=torch.Generator().manual_seed(cfg.seed),
        )

    def prepare(self, accelerator, model, cfg) -> None:
        """Turn the model's dropout off, shard the reference and held-out loaders and fill both
        tables' reference columns from ``model`` as it is now (call before restoring a checkpoint)."""
        disable_dropout(model)
        loaders = []
        for rows, collator in ((self.train, self.train_collator), (self.held, self.held_collator)):
            dl = DataLoader(
                rows,
                batch_size=cfg.per_device_eval_batch_size,
                collate_fn=collator,
                generator=torch.Generator().manual_seed(cfg.seed),
            )
            loaders.append(accelerator.prepare_data_loader(dl) if len(rows) else None)
        self.reference_dl, self.held_dl = loaders
        for dl, collator in ((self.reference_dl, self.train_collator), (self.held_dl, self.held_collator)):
            if dl is not None:
                _fill_reference(accelerator, model, dl, self.objective, collator.table)
        log.info(f"reference log-probabilities of {len(self.train)} train and {len(self.held)} held-out rows computed")

    def loss(self, model, batch) -> torch.Tensor:
        return preference_loss(model, batch, self.objective, self.beta, self.sft_weight).loss

    @torch.no_grad()
    def evaluate(self, accelerator, model) -> dict:
        """eval_pref_accuracy, eval_pref_margin and eval_pref_rows on the held-out rows ({} without any)."""
        if self.held_dl is None:
            return {}
        was_training = model.training
        model.eval()
        correct, margin = [], []
        for batch in self.held_dl:
            out = preference_loss(model, batch, self.objective, self.beta)
            right, diff = accelerator.gather_for_metrics((out.correct, out.margin.float()))
            correct.append(right.cpu())
            margin.append(diff.cpu())
        model.train(was_training)
        correct, margin = torch.cat(correct), torch.cat(margin)
        return {
            "eval_pref_accuracy": correct.mean().item(),
            "eval_pref_margin": margin.mean().item(),
            "eval_pref_rows": len(correct),
        }

    def state(self) -> dict:
        """What a checkpoint keeps for a resumed run: the start evaluation's figures."""
        return {STATE_KEY: self.start}

    def restored(self, state: dict) -> None:
        self.start = dict(state.get(STATE_KEY) or {})

    def summary(self, results: dict) -> dict:
        """all_results.json's preference figures: the start evaluation's, how far BLEU fell from it
        (``bleu_drop``: start minus final) and ``bleu_drop_flag`` (fell more than BLEU_DROP_LIMIT)."""
        out = {"objective": self.objective, "preference_rows": len(self.train), **self.start}
        if "start_eval_bleu" in self.start:
            out["bleu_drop"] = self.start["start_eval_bleu"] - results["eval_bleu"]
            out["bleu_drop_flag"] = out["bleu_drop"] > BLEU_DROP_LIMIT
            if out["bleu_drop_flag"]:
                log.warning(
                    f"BLEU fell {out['bleu_drop']:.2f} points below its start ({self.start['start_eval_bleu']:.2f} "
                    f"-> {results['eval_bleu']:.2f}): the preference tuning cost reply quality; try a larger --beta, "
                    "a smaller --learning_rate or fewer steps, or --sft_weight"
                )
        return out


def disable_dropout(model) -> None:
    """No dropout in a preference run (as TRL's DPO/KTO trainers do by default): the reference is
    computed without it, and a policy with it would read every reply as less likely than the
    reference does, a bias in each row's reward from the first step. BlenderBot's layers keep
    their rates as float attributes; peft's LoRA dropout is an nn.Dropout. The saved config keeps
    the model's own rates (for later SFT runs)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("dropout", "activation_dropout", "attention_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


@torch.no_grad()
def _fill_reference(accelerator, model, loader, objective: str, table: torch.Tensor) -> None:
    """Each row's two reply log-probabilities under ``model`` (eval mode: no dropout) into ``table``,
    from every process's shard (gather_for_metrics drops the rows repeated to even out the last batch)."""
    was_training = model.training
    model.eval()
    for batch in loader:
        first, second = reply_logps(model, batch, objective)
        rows, first, second = accelerator.gather_for_metrics((batch["row"], first.float(), second.float()))
        table[rows.cpu()] = torch.stack([first, second], dim=1).cpu()
    model.train(was_training)


def load(cfg, tokenizer) -> Preferences | None:
    """The run's preference rows, validated and tokenized (None for ``--objective sft``). A bad file
    is a DataError naming it, the row and the problem (its ``file``: the error event's)."""
    if cfg.objective == "sft":
        return None
    train, held = load_preferences(cfg.preference_file, cfg.objective, cfg.preference_validation_file)
    if not len(held):
        log.warning(
            f"{cfg.preference_file}: fewer than 10 rows and no --preference_validation_file: no held-out "
            "preference rows, so evaluations report no eval_pref_accuracy"
        )
    if cfg.packing:
        log.info("preference batches are not packed (each row's replies share its source): --packing ignored")
    cfg.packing = False  # (recorded so in training_args.json)
    train, held = (_numbered(tokenize(rows, tokenizer, cfg, cfg.objective)) for rows in (train, held))
    pad = tokenizer.pad_token_id

    def collator(rows: Dataset) -> WithReference:
        return WithReference(PreferenceCollator(pad), cfg.objective, torch.full((len(rows), 2), float("nan")))

    auto = cfg.per_device_train_batch_size == "auto"
    return Preferences(
        cfg.objective, cfg.beta, cfg.sft_weight, train, held, collator(train), collator(held), auto_batch=auto
    )


def start_evaluation(run) -> None:
    """A fresh preference run's evaluation before its first step: BLEU (validation, per kind,
    held-out feedback) and the held-out preference figures, as an ``eval`` event at step 0 marked
    ``start``, kept in ``run.prefs.start`` (and in every checkpoint) for ``summary``."""
    cfg, acc, prefs = run.cfg, run.accelerator, run.prefs
    loaders = (run.eval_dl, run.feedback_dl)
    results = evaluate_all(acc, run.model, loaders, run.tokenizer, cfg, zero3=run.zero_stage == 3, should_stop=run.stop)
    if results is None:  # stop requested: the loop's first check stops the run
        return
    results.update(prefs.evaluate(acc, run.model))
    figures = {"eval_bleu": results["eval_bleu"], "eval_loss": results["eval_loss"], **scores(results)}
    prefs.start = {f"start_{k}": v for k, v in figures.items() if k in ("eval_bleu", *PREF_FIGURES)}
    seconds, samples = results["eval_seconds"], results["samples"][:20]
    run.metrics.write("eval", step=0, epoch=0, start=True, **figures, eval_epoch_seconds=seconds, samples=samples)
    log.info(f"start: {describe(figures)}")
    if cfg.with_tracking:
        acc.log(figures, step=0)


PREF_FIGURES = ("eval_pref_accuracy", "eval_pref_margin")


def describe(figures: dict) -> str:
    """One log line's figures: BLEU, and the preference accuracy and margin when there are some."""
    text = f"BLEU {figures['eval_bleu']:.2f}"
    if "eval_pref_accuracy" in figures:
        text += (
            f", preference accuracy {figures['eval_pref_accuracy']:.3f} "
            f"(margin {figures['eval_pref_margin']:.2f}) on {figures['eval_pref_rows']} held-out rows"
        )
    return text
