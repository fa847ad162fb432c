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


def write_model_card(folder: Path, cfg, results: dict, world_size: int) -> None:
    data = ModelCardData(
        base_model=cfg.model_name_or_path if "/" in cfg.model_name_or_path else None,
        datasets=[cfg.dataset_name]
        if cfg.dataset_name and not cfg.train_file and cfg.dataset_name != "sample"
        else None,
        library_name="transformers",
        pipeline_tag="text2text-generation",
        tags=["blenderbot", "persona-chat", "deepspeed", "accelerate"],
    )
    bleu = results.get("eval_bleu")
    command = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    content = f"""---
{data.to_yaml()}
---

# {cfg.hub_model_id or folder.parent.name}

BlenderBot fine-tuned for persona / emotion / task / topic-conditioned chat in the MuDoConv format.

- Base model: `{cfg.model_name_or_path}`
- Data: `{cfg.train_file or cfg.dataset_name}` ({results.get("train_samples", "?")} training rows)
- Evaluation: sacreBLEU {bleu if bleu is None else round(bleu, 2)} on {results.get("eval_samples", "?")} validation rows
  (beams {cfg.num_beams}, min length {cfg.val_min_target_length}, max length {cfg.val_max_target_length})
- Hardware: {hardware()}, {world_size} process(es)
- Input format: `{cfg.source_prefix}` + the MuDoConv source (see `training_args.json`)

Trained with:

```
{command}
```
"""
    ModelCard(content).save(folder / "README.md")


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
