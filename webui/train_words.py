"""How the Train tab says things: settings named as the form labels them, a command one flag a
line, an upload's first rows. Plain text functions (``webui.train_handlers`` uses them)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping


def in_form_words(text: str, labels: Mapping[str, str]) -> str:
    """``text`` (a message of the spec or the CLI's config) with each setting named as the form
    labels it: "learning_rate is required" and "--learning_rate must be > 0" become "Learning rate
    is required" and "Learning rate must be > 0"."""
    for name in sorted(labels, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-])(?:--)?{re.escape(name)}(?![\w])", lambda _, label=labels[name]: label, text)
    return text


def command_lines(line: str) -> str:
    """A shell command line as one flag (and its value) per line, joined by backslash-newlines:
    the same command, readable (a run's command gives every setting, ~50 flags)."""
    tokens = shlex.split(line)
    lines: list[list[str]] = []
    for i, token in enumerate(tokens):
        if not lines or (token.startswith("-") and i > 2):  # (the first line: python -m accelerate…)
            lines.append([])
        lines[-1].append(shlex.quote(token))
    return " \\\n  ".join(" ".join(words) for words in lines)


def preview_markdown(name: str, rows: int, preview: list[str]) -> str:
    lines = [
        (
            f"✅ **{name}**: {rows} rows, valid. The encoder input of the first rows, exactly as the model "
            "reads it (before long dialogues are shortened to fit):"
        )
    ]
    lines += [f"\n```text\n{text}\n```" for text in preview]
    return "\n".join(lines)
