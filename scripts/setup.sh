#!/usr/bin/env bash
# Sets up a fresh clone in its own virtual environment (.venv, or $VENV): PyTorch (the CPU build
# where there is no CUDA GPU, so pip never pulls the multi-GB CUDA one), the app and training
# requirements, and a check that DeepSpeed can compile its CPU op (it needs a C++ compiler).
# With --dev, also the test tools and Debian's chromium for the browser test.
# Usually run through `make run` / `make test` (Makefile); safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH=2.13.0
dev=0
[ "${1:-}" = "--dev" ] && dev=1

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "installing PyTorch $TORCH (CUDA build: a GPU is present)"
    "${pip[@]}" "torch==$TORCH"
  else
    say "installing PyTorch $TORCH (CPU build: no CUDA GPU here)"
    # A local or cached CPU wheel first; else PyTorch's own CPU index (PyPI has only CUDA builds).
    "${pip[@]}" "torch==$TORCH+cpu" 2>/dev/null \
      || "${pip[@]}" "torch==$TORCH+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi

say "installing the requirements"
"${pip[@]}" -r requirements.txt
if [ "$dev" = 1 ]; then
  "${pip[@]}" -r requirements-dev.txt
fi

# DeepSpeed builds a C++ op (its CPU Adam) the first time a CPU run uses it.
if ! command -v "${CXX:-g++}" >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing g++ (DeepSpeed compiles its CPU op with it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++
  else
    say "WARNING: no C++ compiler: training on the CPU needs one for DeepSpeed's CPU op (apt-get install g++)"
  fi
fi

# Built now rather than by the first run (about 2 minutes on 2 cores), so that no run stopped mid-build
# leaves torch's lock file that every later run would wait on. A CUDA machine builds nothing here.
if command -v "${CXX:-g++}" >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1; then
  say "building DeepSpeed's CPU ops"
  "$VENV/bin/python" -m finetune.cpu_ops || say "WARNING: DeepSpeed's CPU ops did not build; the first CPU run will try again"
fi

# The browser test drives Debian's chromium through Playwright; Playwright's own browser
# download is never used. Without it that one test is skipped, saying why.
if [ "$dev" = 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  say "installing Debian's chromium for the browser test"
  { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    || say "WARNING: could not install chromium; the browser test will be skipped"
fi
say "ready: $VENV"
