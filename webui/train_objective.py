"""The Train tab's choice of objective: SFT (learn the replies), DPO (chosen over rejected pairs) or
KTO (good and bad replies), with DPO/KTO's beta and optional SFT weight, on the accepted feedback.

A piece of the form (``build`` and ``connect``, placed by ``webui.train_tab``) and the plain
function that turns its values into TrainConfig's settings (``settings``, used by
``webui.train_handlers``): for DPO or KTO the store's accepted feedback is written as preference
rows (``finetune.feedback_preferences``) under the data root, in a folder named after its content,
and that file is the run's ``--preference_file``; a browser never names a path. The line under the
choice says how many rows of each kind there are; too few is a refusal naming what to do.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import gradio as gr

from finetune.feedback import FeedbackStore
from finetune.feedback_preferences import PreferenceCounts, export_preferences, preference_counts
from finetune.preference_data import HOLDOUT_EVERY

# The form's fields, TrainConfig's names (webui.train_handlers.FORM_FIELDS includes them).
FIELDS = ("objective", "beta", "sft_weight")
OBJECTIVE_CHOICES = [
    ("SFT: learn the replies", "sft"),
    ("DPO: chosen over rejected (pairs)", "dpo"),
    ("KTO: good and bad replies", "kto"),
]
MIN_ROWS = 2  # fewer gives each of the CPU's 2 training processes nothing of its own to learn from
PRIVATE = {"api_visibility": "private"}


def build(defaults: Mapping, locked: dict) -> tuple[dict, gr.Markdown]:
    """The fields (call inside the form's layout) by FIELDS name, and the line of preference row
    counts under them. Beta and the SFT weight show only for DPO and KTO."""
    preference = defaults["objective"] != "sft"
    with gr.Row(elem_classes="train-pair"):
        objective = gr.Radio(
            OBJECTIVE_CHOICES,
            value=defaults["objective"],
            label="Objective",
            info="DPO and KTO learn from the accepted feedback's preferences (corrections, votes, likes)",
            elem_id="train-objective",
            **locked,
        )
        beta = gr.Number(
            defaults["beta"],
            label="Beta (how far from the starting model)",
            visible=preference,
            elem_id="train-beta",
            **locked,
        )
        sft_weight = gr.Number(
            defaults["sft_weight"],
            label="SFT weight (on the chosen reply; 0 = none)",
            visible=preference,
            elem_id="train-sft-weight",
            **locked,
        )
    counts = gr.Markdown(visible=preference, elem_id="train-pref-counts")
    return {"objective": objective, "beta": beta, "sft_weight": sft_weight}, counts


def connect(fields: Mapping, counts: gr.Markdown, store: Callable[[], FeedbackStore]) -> None:
    """Show beta, the SFT weight and the counts line for DPO and KTO; redraw the line when the
    objective changes and when the page loads (``store``: the tab's store, opened on first use)."""

    def redraw(objective):
        preference = objective in ("dpo", "kto")
        shown = gr.update(visible=preference)
        line = counts_line(preference_counts(store()), objective) if preference else ""
        return shown, shown, gr.update(visible=preference, value=line)

    outputs = [fields["beta"], fields["sft_weight"], counts]
    quiet = {"queue": False, "show_progress": "hidden", **PRIVATE}
    gr.on([fields["objective"].change], redraw, fields["objective"], outputs, **quiet)
    gr.on(None, redraw, fields["objective"], outputs, **quiet)  # on page load: the rows accepted since


def counts_line(counts: PreferenceCounts, objective: str) -> str:
    """What the accepted feedback gives each objective, and whether ``objective`` has enough."""
    line = (
        f"Preference rows from the accepted feedback: {_many(counts.corrections, 'pair')} from corrections · "
        f"{_many(counts.votes, 'pair')} from Compare votes · {_many(counts.kto, 'KTO row')} from 👍/👎 "
        f"({counts.likes} 👍, {counts.dislikes} 👎)."
    )
    problem = too_few(counts, objective)
    if problem:
        return f"{line}\n\n⚠️ {problem}"
    rows = counts.of(objective)
    held = rows // HOLDOUT_EVERY
    line += f" {objective.upper()} trains on {rows - held}"
    if held:
        return line + f" and measures preference accuracy on {held} held out (every {HOLDOUT_EVERY}th)."
    return line + f" (under {HOLDOUT_EVERY} rows none are held out, so no preference accuracy is measured)."


def _many(n: int, what: str) -> str:
    return f"**{n}** {what}{'' if n == 1 else 's'}"


def too_few(counts: PreferenceCounts, objective: str) -> str | None:
    """Why ``objective`` cannot train on these counts (None: it can)."""
    rows = counts.of(objective)
    if objective not in ("dpo", "kto") or rows >= MIN_ROWS:
        return None
    what = (
        "pairs: accept corrections (with the bot's reply) or Compare votes (not ties)"
        if objective == "dpo"
        else "rows: accept liked or disliked replies"
    )
    have = f"there {'is' if rows == 1 else 'are'} {rows}"
    return f"{objective.upper()} needs at least {MIN_ROWS} preference {what} under Feedback from the chat; {have}"


def settings(store: FeedbackStore, values: Mapping) -> dict:
    """TrainConfig's objective settings of the form's ``values``: none for SFT (beta and the SFT
    weight keep their values for the next DPO/KTO run, unused); for DPO and KTO the objective,
    beta, SFT weight and the accepted feedback's preference rows as ``preference_file``.
    ValueError (meant for the trainer) when there are too few rows."""
    objective = values["objective"]
    if objective == "sft":
        return {}
    if objective not in ("dpo", "kto"):
        raise ValueError(f"objective must be one of sft, dpo, kto, got {str(objective)[:20]!r}")
    problem = too_few(preference_counts(store), objective)
    if problem:
        raise ValueError(problem)
    path = export_for_run(store, objective)
    return {"objective": objective, "beta": values["beta"], "sft_weight": values["sft_weight"], "preference_file": path}


def export_for_run(store: FeedbackStore, objective: str) -> str:
    """The accepted feedback's ``objective`` rows as a file under the data root, in a folder named
    after its content: the same rows again (each Show command, each Start) reuse that folder, so the
    exports grow only when a trainer accepts or edits something."""
    exports = store.path.parent / "exports"
    tmp = exports / f".tmp-{secrets.token_hex(4)}"
    try:
        path, _ = export_preferences(store, objective, tmp)
        final = exports / f"preferences-{objective}-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
        try:
            tmp.rename(final)
        except OSError:  # the same rows were exported before (or just now, by another page)
            if not (final / path.name).is_file():
                raise
        return str(Path(final) / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
