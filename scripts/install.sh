#!/usr/bin/env bash
# Creates .venv and installs bertforge with everything it needs; a second run reuses it.
#
#   scripts/install.sh            runtime + the dev and dataflow extras (what `make test` needs)
#   scripts/install.sh dev        runtime + dev only (`make demo`: transformers checks the export)
#
# The extras are pyproject.toml's, comma-separated. The dataflow extra (apache-beam[gcp], ~40
# Google Cloud packages) is only for submitting to Dataflow and its tests: leaving it out took
# the install from 2 min 48 s to 2 min 11 s (2-core AVX2 EPYC, 2026-11-26, pip, cache cold).
# A later run asking for extras not yet installed adds them; one asking for fewer reuses all.
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
#  - uv installs (BERTFORGE_INSTALLER=pip: pip alone): pip installs uv into the venv, and uv
#    the rest, from pip's sources (index, extra indexes, find-links, constraints: `pip config`)
#    with pip's rule of the best version from any of them, and with the bytecode that pip would
#    write. Measured on a 2-core AVX2 EPYC, 2026-11-26, idle, fresh clone, extras dev, caches
#    cold: pip 2 min 14 s, uv 1 min 17 s; the demo's first run then took the same time after
#    either. A step uv fails is tried again with pip, which then installs the rest.
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
EXTRAS=${1:-dev,dataflow}
STAMP="$VENV/.bertforge-installed"  # the fingerprint below, then the extras installed
LINKED="$VENV/.bertforge-linked"
STRICT_EDITABLE=(-C editable_mode=strict)  # pip's and uv's flag

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
INSTALL=$PIP  # pip, or uv once it is installed (same arguments)

step() {  # step "what is installed" COMMAND...: the command's output to LOG
  local what=$1
  shift
  echo "bertforge:   $what"
  echo "### $what: $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 && return 0
  if [ "$INSTALL" != "$PIP" ]; then
    # uv and pip read some sources differently (a mirror's quirks, a constraint's syntax).
    echo "bertforge:   uv failed there (see $LOG); pip installs it and the rest"
    INSTALL=$PIP
    echo "### $what, again with pip" >> "$LOG"
    "$@" >> "$LOG" 2>&1 && return 0
  fi
  echo "bertforge: installing $what failed; the end of $LOG:" >&2
  tail -n 40 "$LOG" >&2
  exit 1
}

installer() { $INSTALL "$@"; }  # uv's pip or pip, whichever installs at the time of the call

installed_extras() { sed -n 2p "$STAMP" 2>/dev/null; }

# The extras asked for and those already installed, sorted, comma-separated.
all_extras() {
  echo "$EXTRAS,$(installed_extras)" | tr ',' '\n' | sed '/^$/d' | LC_ALL=C sort -u | paste -sd, -
}

if [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$(fingerprint)" ] \
    && [ "$(all_extras)" = "$(installed_extras)" ]; then
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
echo "bertforge: installing into $VENV (a few minutes the first time; the installers' output: $LOG)"

cpu_torch() {
  # The CPU wheel from pip's own sources first (a find-links folder or a mirror; its
  # dependencies come from PyPI), then from PyTorch's CPU index.
  installer install "torch==$TORCH_VERSION+cpu" \
    || installer install "torch==$TORCH_VERSION+cpu" --extra-index-url "$TORCH_CPU_INDEX"
}

pip_setting() {  # pip_setting NAME: pip's configured value (pip.conf or PIP_*), else nothing
  local upper
  upper=$(echo "$1" | tr 'a-z-' 'A-Z_')
  local from_env="PIP_$upper"
  if [ -n "${!from_env:-}" ]; then echo "${!from_env}"; return; fi
  $PIP config get "global.$1" 2>/dev/null | tr '\n' ' ' | sed 's/ *$//' || true
}

use_uv() {
  # uv reads none of pip's configuration: hand it pip's sources, so that both install from
  # the same places (a mirror, a wheel folder, a company index) under the same constraints.
  $PIP install uv || return 1
  local value
  value=$(pip_setting index-url); [ -z "$value" ] || export UV_DEFAULT_INDEX="$value"
  value=$(pip_setting extra-index-url); [ -z "$value" ] || export UV_EXTRA_INDEX_URL="$value"
  value=$(pip_setting find-links); [ -z "$value" ] || export UV_FIND_LINKS="${value// /,}"
  value=$(pip_setting constraint); [ -z "$value" ] || export UV_CONSTRAINT="$value"
  value=$(pip_setting cert); [ -z "$value" ] || export SSL_CERT_FILE="$value"
  export UV_INDEX_STRATEGY=unsafe-best-match  # pip's rule: the best version of any index
  # pip's default too: the bytecode written now. Without it every first import compiles: the
  # demo's first run took 36 s for its corpus stage (3.8 s warm) and 78 s for its prepare
  # (10 s), each Beam worker compiling apache_beam again.
  export UV_COMPILE_BYTECODE=1
  export UV_PYTHON="$VENV/bin/python"  # into the venv, whatever is activated
  INSTALL="$VENV/bin/uv pip"
}

step "pip, setuptools, wheel" $PIP install --upgrade pip setuptools wheel
if [ "${BERTFORGE_INSTALLER:-uv}" = uv ]; then
  echo "### uv: $PIP install uv" >> "$LOG"
  if use_uv >> "$LOG" 2>&1; then
    echo "bertforge:   uv (it installs the rest: faster than pip)"
  else
    echo "bertforge:   uv could not be installed; pip installs the rest (slower)"
  fi
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "torch $TORCH_VERSION, CUDA build (a GPU was found)" installer install "torch==$TORCH_VERSION"
  else
    step "torch $TORCH_VERSION, CPU build (no GPU found)" cpu_torch
  fi
fi
# DS_BUILD_OPS=0: ops compile just in time, on the machine that runs them.
deepspeed_against_torch() { DS_BUILD_OPS=0 installer install --no-build-isolation "deepspeed>=0.19"; }  # pyproject's floor
step "deepspeed (built against that torch)" deepspeed_against_torch
EXTRAS=$(all_extras)
step "bertforge and its dependencies (ray, apache-beam, ...; editable, extras $EXTRAS)" \
  installer install -e ".[$EXTRAS]" "${STRICT_EDITABLE[@]}"

printf '%s\n%s\n' "$(fingerprint)" "$EXTRAS" > "$STAMP"
package_files > "$LINKED"
# Versions from the packages' metadata: importing deepspeed prints its accelerator notice.
echo "bertforge: installed $("$VENV/bin/python" -c '
from importlib.metadata import version
print("torch " + version("torch") + ", deepspeed " + version("deepspeed"))' 2>>"$LOG"), \
bertforge ($VENV/bin/bertforge)"
