"""A model as people see it: its name (never a server folder) and its saved validation BLEU, with
what that figure was measured on and whether it compares with another model's (finetune.measure),
and for a DPO / KTO run its held-out preference accuracy.
Plain functions; the model picker (webui.chat_handlers) and the review panel use them."""

from __future__ import annotations

from pathlib import Path

from chat.adapters import base_of
from chat.layout import DEMO_DIR, FINAL
from chat.serving import adapter_dir
from finetune.jobs.status import bleu_parts, bleu_parts_text, saved_results
from finetune.measure import comparable, describe, saved_measure


def model_label(spec: str) -> str:
    """A model's name for visitors, never a server path: "demo model", a run's RUN/final, a folder's
    name; a LoRA adapter with its base: "persona-bob/final (LoRA on demo model)"."""
    path = Path(spec)
    if not (path.is_absolute() or path.exists()):
        return spec  # a Hub id or a preset
    if path.resolve() == DEMO_DIR:
        return "demo model (tiny, bundled)"
    label = f"{path.parent.name}/{path.name}" if path.name == FINAL else path.name
    folder = adapter_dir(spec)
    return f"{label} (LoRA on {base_label(folder)})" if folder is not None else label


def base_label(adapter: Path) -> str:
    """The base an adapter folder names, as visitors see it: "demo model", a run's name, a Hub id."""
    try:
        name = base_of(adapter)[0]
    except ValueError:
        return "an unknown base"
    path = Path(name)
    if not (path.is_absolute() or path.exists()):
        return name  # a Hub id or a preset
    if path.resolve() == DEMO_DIR:
        return "demo model"
    return path.parent.name if path.name == FINAL else path.name


def model_bleu(spec: str) -> float | None:
    """The validation BLEU a local model folder was saved with (its all_results.json), if any."""
    bleu = saved_results(spec).get("eval_bleu") if spec else None
    return float(bleu) if isinstance(bleu, (int, float)) and not isinstance(bleu, bool) else None


def model_pref_accuracy(spec: str) -> float | None:
    """The held-out preference accuracy (a share, 0..1) a DPO / KTO run was saved with, if any."""
    value = saved_results(spec).get("eval_pref_accuracy") if spec else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def pref_text(spec: str) -> str:
    """ "preference accuracy 83% (12 held-out rows)" for a DPO / KTO run's saved figure; "" without one."""
    accuracy = model_pref_accuracy(spec)
    if accuracy is None:
        return ""
    rows = saved_results(spec).get("eval_pref_rows")
    held = f" ({rows} held-out rows)" if isinstance(rows, int) and not isinstance(rows, bool) else ""
    return f"preference accuracy {100 * accuracy:.0f}%{held}"


def measured(spec: str | None) -> dict | None:
    """How ``spec``'s saved BLEU was measured (None: no figure, or no record of how)."""
    return saved_measure(spec) if model_bleu(spec) is not None else None


def same_measure(spec: str, other: str | None) -> bool:
    """Were the saved BLEU figures of two models measured the same way (finetune.measure)?"""
    return comparable(measured(spec), measured(other))


def bleu_note(spec: str | None, serving: str | None = None) -> str:
    """Under the picker: the picked model's BLEU, on what it was measured, by kind (and on held-out
    chat feedback), and whether it compares with the ``serving`` model's."""
    bleu = model_bleu(spec)
    if bleu is None:
        return f"{model_label(spec)}: {pref_text(spec)}." if pref_text(spec) else ""
    results = saved_results(spec)
    text = f"{model_label(spec)}: BLEU {bleu:.1f} on {describe(measured(spec), results.get('eval_samples'))}"
    parts = bleu_parts_text(bleu_parts(results))
    text += f". By kind: {parts}" if parts else ""
    text += f". {pref_text(spec).capitalize()}" if pref_text(spec) else ""
    other = model_bleu(serving) if serving and serving != spec else None
    if other is not None and not same_measure(spec, serving):
        text += (
            f". Not comparable with the serving model's BLEU {other:.1f}, measured another way "
            f"({describe(measured(serving), saved_results(serving).get('eval_samples'))})"
        )
    return text + "."


def with_bleu(label: str, spec: str, serving: str | None = None) -> str:
    """A picker label with the model's BLEU, marked when it was measured otherwise than the serving model's."""
    bleu, accuracy = model_bleu(spec), model_pref_accuracy(spec)
    pref = f" · pref {100 * accuracy:.0f}%" if accuracy is not None else ""  # DPO / KTO runs
    if bleu is None:
        return label + pref
    otherwise = serving not in (None, spec) and measured(serving) is not None and not same_measure(spec, serving)
    return f"{label} · BLEU {bleu:.1f}" + (" (measured otherwise)" if otherwise else "") + pref
