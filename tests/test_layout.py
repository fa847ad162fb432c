"""The package layout holds: imports go one way, app.py -> webui/ -> finetune/ -> chat/, with api/
(the OpenAI-compatible routes) beside webui/, and only app.py and webui/ know gradio. bench/ may
use chat/ and finetune/, and drive the running app through its clients; nothing uses bench/."""

import ast
from pathlib import Path

import pytest

from chat.layout import ROOT

PACKAGES = ("chat", "finetune", "webui", "api", "bench")
# What each part of the project may import of the project (besides itself).
ALLOWED = {
    "chat": set(),
    "finetune": {"chat"},
    "webui": {"chat", "finetune"},
    "api": {"chat", "finetune"},  # a front door beside webui/, never through it
    "app": {"chat", "finetune", "webui", "api"},
    "bench": {"chat", "finetune"},
}
# Third-party packages that belong to one layer: the web UI, or training.
ONLY_IN = {
    "gradio": {"webui", "app"},
    "gradio_client": {"webui", "app", "bench"},  # bench.api drives the running app like its users
    "accelerate": {"finetune", "bench"},
    "deepspeed": {"finetune", "bench"},
}
MAX_LINES = 500


def sources() -> list[tuple[str, Path]]:
    files = [("app", ROOT / "app.py")]
    for package in PACKAGES:
        files += [(package, path) for path in sorted((ROOT / package).rglob("*.py"))]
    return files


def imported(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, at any depth (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("part", "path"), sources(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v
)
def test_imports_go_one_way(part, path):
    names = imported(path)
    ours = names & {*PACKAGES, "app"}
    assert ours <= ALLOWED[part] | {part}, f"{path.relative_to(ROOT)} imports {sorted(ours - ALLOWED[part] - {part})}"
    for package, parts in ONLY_IN.items():
        assert package not in names or part in parts, f"{path.relative_to(ROOT)} imports {package}"


def test_nothing_imports_the_benchmarks():
    users = [path for part, path in sources() if part != "bench" and "bench" in imported(path)]
    assert users == []


@pytest.mark.parametrize(
    ("part", "path"), sources(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v
)
def test_source_files_stay_short(part, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it (limit {MAX_LINES})"


def test_the_rule_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from webui import auth\n    import gradio as gr\n")
    assert imported(probe) == {"webui", "gradio"}
