#!/usr/bin/env bash
# Creates .venv and installs bertforge with everything it needs; a second run reuses it.
#
#   scripts/install.sh            runtime + dev extras (tests, ruff, transformers for interop)
#
# The console gets one line per step; pip's output goes to .venv/install.log (its tail is shown
# when a step fails).
#
# Why not a plain `pip install -e .`:
#  - torch: an unconstrained requirement on a machine without CUDA pulls several GB of CUDA
#    packages. Without a GPU we install the CPU build first (TORCH_VERSION, default 2.13.0);
#    with a GPU (nvidia-smi present) the default PyPI build, which carries CUDA.
#  - deepspeed: its setup.py imports torch, so it is built without build isolation against the
#    torch installed above (an isolated build would download a second, CUDA torch).
#  - bertforge: setuptools' strict editable mode. `build/__editable__.*/bertforge/` mirrors the
#    package with a link per file and a `.pth` file puts it on sys.path: Python from any
#    directory, mypy, pyright and IDEs all resolve `bertforge.training...` (the default mode's
#    import hook is followed by Python alone). An edit shows at once; a file added, renamed or
#    removed needs the links made again, which a second run does by itself (seconds, offline).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
STAMP="$VENV/.bertforge-installed"
LINKED="$VENV/.bertforge-linked"
STRICT_EDITABLE=(--config-settings editable_mode=strict)

fingerprint() { cat pyproject.toml setup.py scripts/install.sh | sha256sum | cut -d' ' -f1; }

# The names (not the contents) of the package's files, in the folders pyproject.toml's
# [tool.bertforge] package-folders lists: the link tree has one link per file.
package_files() {
  local folders
  folders=$(sed -n 's/^package-folders *= *\[\(.*\)\]/\1/p' pyproject.toml | tr -d '",')
  # shellcheck disable=SC2086  # the folder names are words
  find $folders -type f ! -path '*/__pycache__/*' | LC_ALL=C sort | sha256sum | cut -d' ' -f1
}

# pip's and the builds' output goes to LOG; the console gets a line per step, and the log's
# tail if a step fails.
LOG="$VENV/install.log"
PIP="$VENV/bin/python -m pip"

step() {  # step "what is installed" COMMAND...: the command's output to LOG
  local what=$1
  shift
  echo "bertforge:   $what"
  echo "### $what: $*" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "bertforge: installing $what failed; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ]; then
  if [ "$(cat "$LINKED" 2>/dev/null)" = "$(package_files)" ]; then
    echo "bertforge: reusing the installation in $VENV"
    exit 0
  fi
  echo "bertforge: reusing the installation in $VENV; package files were added, renamed or removed"
  step "bertforge's links to them (editable, no dependencies)" \
    $PIP install --no-deps --no-build-isolation -e . "${STRICT_EDITABLE[@]}"
  package_files > "$LINKED"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
: > "$LOG"
echo "bertforge: installing into $VENV (a few minutes the first time; pip's output: $LOG)"

cpu_torch() {
  # The CPU wheel from pip's own sources first (a find-links folder or a mirror; its
  # dependencies come from PyPI), then from PyTorch's CPU index.
  $PIP install "torch==$TORCH_VERSION+cpu" \
    || $PIP install "torch==$TORCH_VERSION+cpu" --extra-index-url "$TORCH_CPU_INDEX"
}

step "pip, setuptools, wheel" $PIP install --upgrade pip setuptools wheel
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "torch $TORCH_VERSION, CUDA build (a GPU was found)" $PIP install "torch==$TORCH_VERSION"
  else
    step "torch $TORCH_VERSION, CPU build (no GPU found)" cpu_torch
  fi
fi
# DS_BUILD_OPS=0: ops compile just in time, on the machine that runs them.
step "deepspeed (built against that torch)" \
  env DS_BUILD_OPS=0 $PIP install --no-build-isolation "deepspeed>=0.16"
step "bertforge and its dependencies (ray, apache-beam, transformers, ...; editable)" \
  $PIP install -e ".[dev,dataflow]" "${STRICT_EDITABLE[@]}"

fingerprint > "$STAMP"
package_files > "$LINKED"
# Versions from the packages' metadata: importing deepspeed prints its accelerator notice.
echo "bertforge: installed $("$VENV/bin/python" -c '
from importlib.metadata import version
print("torch " + version("torch") + ", deepspeed " + version("deepspeed"))' 2>>"$LOG"), \
bertforge ($VENV/bin/bertforge)"
