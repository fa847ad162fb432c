"""Where the project's things are, and what a finished model folder holds.

One place for these facts: training writes model folders in this layout, the chat engine and
the model picker read them, and the run manager and tests find the shipped data here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (the accelerate configs name files from here)
SAMPLE_DIR = ROOT / "data" / "sample"  # the shipped sample in MuDoConv format (train/validation.jsonl)
DEMO_DIR = ROOT / "chat" / "demo_model"  # served when the Hub is unreachable
DEFAULT_MODEL = "facebook/blenderbot-400M-distill"

# A finished run's model folder: RUN/final/ with save_pretrained files plus these two.
FINAL = "final"
TRAINING_ARGS_FILE = "training_args.json"  # how it was trained: the chat formats input the same way
RESULTS_FILE = "all_results.json"  # eval BLEU and epoch times

# A Hub repo id: "name" or "owner/name", each part letters, digits, "_", "-", "." (not at the ends).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID_RE = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")


def is_hub_id(text: str, owner: bool = False) -> bool:
    """Does ``text`` look like a Hub repo id ("owner/name", or also "name" unless ``owner``)?"""
    return (
        isinstance(text, str)
        and bool(_HUB_ID_RE.match(text))
        and "--" not in text
        and ".." not in text
        and (not owner or "/" in text)
    )


def list_finals(root: str | Path) -> list[Path]:
    """``RUN/final/`` folders under ``root`` that hold a complete model, newest first."""
    found = [
        p.parent
        for p in Path(root).glob(f"*/{FINAL}/config.json")
        if (p.parent / "model.safetensors").is_file() or (p.parent / "model.safetensors.index.json").is_file()
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
