#!/usr/bin/env bash
# Creates .venv and installs bertforge with everything it needs; a second run reuses it.
#
#   scripts/install.sh            runtime + dev extras (tests, ruff, transformers for interop)
#
# Why not a plain `pip install -e .`:
#  - torch: an unconstrained requirement on a machine without CUDA pulls several GB of CUDA
#    packages. Without a GPU we install the CPU build first (TORCH_VERSION, default 2.13.0);
#    with a GPU (nvidia-smi present) the default PyPI build, which carries CUDA.
#  - deepspeed: its setup.py imports torch, so it is built without build isolation against the
#    torch installed above (an isolated build would download a second, CUDA torch).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
STAMP="$VENV/.bertforge-installed"

fingerprint() { cat pyproject.toml setup.py scripts/install.sh | sha256sum | cut -d' ' -f1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ]; then
  echo "bertforge: reusing the installation in $VENV"
  exit 0
fi

echo "bertforge: installing into $VENV (a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip setuptools wheel

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "bertforge: GPU found, installing the CUDA build of torch"
    $PIP install --quiet "torch==$TORCH_VERSION"
  else
    echo "bertforge: no GPU found, installing the CPU build of torch $TORCH_VERSION"
    # The CPU wheel from pip's own sources first (a find-links folder or a mirror; its
    # dependencies come from PyPI), then from PyTorch's CPU index.
    $PIP install --quiet "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || $PIP install --quiet "torch==$TORCH_VERSION+cpu" --extra-index-url "$TORCH_CPU_INDEX"
  fi
fi

# DS_BUILD_OPS=0: ops compile just in time, on the machine that runs them.
DS_BUILD_OPS=0 $PIP install --quiet --no-build-isolation "deepspeed>=0.16"
$PIP install --quiet -e ".[dev,dataflow]"

fingerprint > "$STAMP"
echo "bertforge: installed ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
