#!/usr/bin/env bash
# Builds .whl/gpusite.tar.xz: the Python packages the offline GPU host lacks (gradio and its server,
# openai, peft, datasets, deepspeed) installed for its CPython 3.12 into one folder, xz-compressed to
# fit the device's 64 MiB carry beside the tracked files. Run it HERE, from the project root, after
# `make .venv/.ready-dev` (the versions are the .venv's). On the device (carry .whl/gpusite.tar.xz):
#   tar -C /tmp -xJf .whl/gpusite.tar.xz && export PYTHONPATH=/tmp/gpusite:$PWD
set -euo pipefail
out=${1:-.whl/gpusite.tar.xz}
[ -x .venv/bin/python ] || { echo "no .venv here: run make .venv/.ready-dev first, from the project root" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python scripts/gpu_closure.py scripts/gpu_image_packages.txt \
    gradio openai peft datasets deepspeed > "$tmp/reqs.txt"
grep -v '^deepspeed==' "$tmp/reqs.txt" > "$tmp/wheels.txt"
# DeepSpeed is published as a source archive only; its ops compile on first use, so a pure-Python
# wheel built here works there.
ds=$(grep '^deepspeed==' "$tmp/reqs.txt")
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp/src" "$ds"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/whl" "$tmp"/src/deepspeed-*.tar.gz
host="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086  # $host is a list of flags
python3 -m pip download -q --no-deps $host -d "$tmp/whl" -r "$tmp/wheels.txt"
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-index --no-compile $host --target "$tmp/gpusite" "$tmp"/whl/*.whl
mkdir -p "$(dirname "$out")"
tar -C "$tmp" -cJf "$out" gpusite
echo "$out: $(du -h "$out" | cut -f1), $(wc -l < "$tmp/reqs.txt") packages"
