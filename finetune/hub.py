"""Model card and Hub upload for a final checkpoint folder.

The token comes from ``HF_TOKEN`` or the saved ``hf auth login``; huggingface_hub reads it
itself. This module never reads, prints, logs or writes it; error messages are scrubbed of it
in case a server echoes it back.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import sys
from pathlib import Path

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData

from chat.layout import is_hub_id
from chat.prompt import KINDS
from finetune.evaluate import OTHER_KIND
from finetune.preference import BLEU_DROP_LIMIT

log = logging.getLogger(__name__)


class HubError(RuntimeError):
    """The Hub refused or could not be reached; the local checkpoint (``file``, if given) is intact."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_model_card(folder: Path, cfg, results: dict, world_size: int, adapter_base: str | None = None) -> None:
    """README.md of a final folder: metadata, what it was trained on and how. ``adapter_base``: the
    folder is a LoRA adapter on that base (library peft; the base is what loads it)."""
    base = adapter_base or cfg.model_name_or_path
    data = ModelCardData(
        # The Hub refuses a card whose base_model is no Hub id (a preset, a local folder): named in the text only.
        base_model=base if is_hub_id(base, owner=True) else None,
        datasets=[cfg.dataset_name]
        if cfg.dataset_name and not cfg.train_file and cfg.dataset_name != "sample"
        else None,
        library_name="peft" if adapter_base else "transformers",
        pipeline_tag="text2text-generation",
        tags=["blenderbot", "persona-chat", "deepspeed", "accelerate", *(["lora"] if adapter_base else [])],
    )
    bleu = results.get("eval_bleu")
    command = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    content = f"""---
{data.to_yaml()}
---

# {cfg.hub_model_id or folder.parent.name}

{_what(cfg, adapter_base)}

- Base model: `{base}`
- Data: `{cfg.train_file or cfg.dataset_name}` ({results.get("train_samples", "?")} training rows)
- Evaluation: sacreBLEU {bleu if bleu is None else round(bleu, 2)} on {results.get("eval_samples", "?")} validation rows
  (beams {cfg.num_beams}, min length {cfg.val_min_target_length}, max length {cfg.val_max_target_length})
{_feedback_lines(cfg, results)}{_preference_lines(cfg, results)}- Hardware: {hardware()}, {world_size} process(es)
- Input format: `{cfg.source_prefix}` + the MuDoConv source (see `training_args.json`)

{_kind_table(results)}{_context_lines(results)}Trained with:

```
{command}
```
"""
    ModelCard(content).save(folder / "README.md")


def _what(cfg, adapter_base: str | None) -> str:
    """The card's first line: a fine-tuned model, or a LoRA adapter and how to load it."""
    if adapter_base is None:
        return "BlenderBot fine-tuned for persona / emotion / task / topic-conditioned chat in the MuDoConv format."
    modules = ", ".join(cfg.lora_target_modules)
    return f"""A LoRA adapter (r {cfg.lora_r}, alpha {cfg.lora_alpha}; {modules}) for BlenderBot `{adapter_base}`,
trained for persona / emotion / task / topic-conditioned chat in the MuDoConv format. Load it with peft on its base:
`PeftModel.from_pretrained(BlenderbotForConditionalGeneration.from_pretrained(base), this folder)`, or
make a full model of it with `python -m finetune.merge --adapter_dir <this folder> --output_dir <dir>`."""


def _round(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def _feedback_lines(cfg, results: dict) -> str:
    """The card's lines about feedback rows (file names only: the folders are the server's)."""
    if not getattr(cfg, "feedback_file", None):
        return ""
    lines = f"- Feedback: `{Path(cfg.feedback_file).name}` mixed in at ratio {cfg.feedback_ratio}\n"
    if "eval_bleu_feedback" in results:
        lines += (
            f"- Held-out feedback: sacreBLEU {_round(results['eval_bleu_feedback'])}, eval loss "
            f"{_round(results.get('eval_loss_feedback'))} on {results.get('eval_rows_feedback', '?')} rows "
            f"(`{Path(cfg.feedback_validation_file).name}`)\n"
        )
    return lines


def _preference_lines(cfg, results: dict) -> str:
    """The card's lines about preference tuning (finetune.preference_train): the objective, the
    held-out preference figures against the start's, and a BLEU that fell from its start."""
    if getattr(cfg, "objective", "sft") == "sft":
        return ""
    extra = f", SFT weight {cfg.sft_weight}" if cfg.sft_weight else ""
    lines = (
        f"- Objective: {cfg.objective.upper()} (beta {cfg.beta}{extra}) on {results.get('preference_rows', '?')} "
        f"preference rows (`{Path(cfg.preference_file).name}`)\n"
    )
    if "eval_pref_accuracy" in results:
        lines += (
            f"- Held-out preferences: accuracy {_round(results['eval_pref_accuracy'])} "
            f"(start {_round(results.get('start_eval_pref_accuracy'))}), log-probability margin "
            f"{_round(results.get('eval_pref_margin'))} (start {_round(results.get('start_eval_pref_margin'))}) on "
            f"{results.get('eval_pref_rows', '?')} rows\n"
        )
    if "start_eval_bleu" in results:
        flag = f" **(fell more than {BLEU_DROP_LIMIT:g} points: flagged)**" if results.get("bleu_drop_flag") else ""
        lines += f"- sacreBLEU at the start: {_round(results['start_eval_bleu'])}{flag}\n"
    return lines


def _kind_table(results: dict) -> str:
    """A "BLEU by kind" table of the validation rows (empty when the results have none)."""
    kinds = [k for k in (*KINDS, OTHER_KIND) if f"eval_bleu_{k}" in results]
    if not kinds:
        return ""
    rows = "".join(
        f"| {k} | {_round(results[f'eval_bleu_{k}'])} | {results.get(f'eval_rows_{k}', '?')} |\n" for k in kinds
    )
    return f"BLEU by kind (validation rows):\n\n| kind | sacreBLEU | rows |\n| --- | ---: | ---: |\n{rows}\n"


def _context_lines(results: dict) -> str:
    """The context score (finetune/context_score.py): does a reply depend on the context it was given?"""
    if results.get("eval_context_hits") is None:
        return ""
    kinds = ", ".join(
        f"{k} {results[f'eval_context_hits_{k}']:.2f}"
        for k in (*KINDS, OTHER_KIND)
        if f"eval_context_hits_{k}" in results
    )
    return (
        f"Context score (the true context gives the generated reply the highest likelihood of "
        f"{round(1 / results['eval_context_chance']) if results.get('eval_context_chance') else '?'} candidates): "
        f"**{results['eval_context_hits']:.2f}** on {results.get('eval_context_rows', '?')} rows ({kinds}); "
        f"chance {_round(results.get('eval_context_chance'))}, the dataset's own replies "
        f"{_round(results.get('eval_context_hits_gold'))}.\n\n"
    )


def _scrub(text: str) -> str:
    token = os.environ.get("HF_TOKEN")
    return text.replace(token, "***") if token else text


def push(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create the repo if needed and upload ``folder``; returns the repo URL."""
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Upload fine-tuned BlenderBot")
    except Exception as err:  # network, auth, offline mode: all end the same way for the user
        first = str(err).splitlines()[0] if str(err) else ""
        raise HubError(
            _scrub(
                f"could not push {folder} to {repo_id} ({type(err).__name__}: {first}). "
                "Check the network, HF_TOKEN or `hf auth login`, and the repo name. "
                f"The local checkpoint in {folder} is intact."
            ),
            file=str(folder),
        ) from None
    return str(url)
