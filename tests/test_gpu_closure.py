"""scripts/gpu_closure.py: what the GPU host must be sent is what the named packages need, less the
host's image, at the versions installed here."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from chat.layout import ROOT

SCRIPT = ROOT / "scripts" / "gpu_closure.py"


def closure(tmp_path, image: list[str], *names: str) -> dict[str, str]:
    listed = tmp_path / "image.txt"
    listed.write_text("\n".join(image) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(listed), *names], check=True, capture_output=True, text=True
    ).stdout
    return dict(line.split("==") for line in out.split())


def test_requirements_are_followed_and_the_image_left_out(tmp_path):
    found = closure(tmp_path, ["numpy", "pandas", "huggingface_hub", "httpx"], "gradio")
    assert found["gradio"] == version("gradio")
    assert found["gradio-client"] == version("gradio_client")  # a requirement of a requirement
    assert "fastapi" in found and "starlette" in found
    for left_out in ("numpy", "pandas", "huggingface-hub", "httpx", "torch", "transformers"):
        assert left_out not in found
    found_all = closure(tmp_path, [], "gradio")
    assert {"numpy", "pandas", "huggingface-hub"} <= set(found_all)


def test_a_package_not_installed_is_an_error(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text("")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(listed), "no-such-package-here"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "no-such-package-here is not installed" in run.stderr
