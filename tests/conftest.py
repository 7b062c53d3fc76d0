"""Suite-wide: the longest modules run first.

`make test` spreads whole modules over two pytest-xdist workers (`--dist loadscope
--no-loadscope-reorder`: a module's fixtures, such as one Ray run shared by its tests, are set
up once, on one worker). A worker takes the next module in collection order when it runs dry,
so the modules that take minutes (mostly waiting on Ray: starts, worker groups, jobs) start at
once on both workers, and the hundreds of short tests fill in around and after them instead of
a long module starting last and running alone. The order changes nothing else: each module
stands on its own.

And one `ninja` for every process of the suite. DeepSpeed compiles its CPU shared-memory op
with whichever `ninja` is first on PATH: this interpreter's (1.13, pip) where the venv's bin
comes first (`ray start` nodes, hence jobs), the system's (1.11) elsewhere. Their build logs
differ in format (v7, v5), so each switch from one to the other recompiled the op from scratch:
a minute of both cores, several times a suite.

And one precision branch on every machine: `precision="auto"` picks bf16 on a CPU with native
bf16 (Zen 4, Sapphire Rapids) and fp32 elsewhere, so a test that trains with the default would
take another branch, and other numbers, on another machine. The suite answers the question for
the CPU (`BERTFORGE_CPU_BF16`, training/precision.py): auto means fp32 here, in every process
the suite starts (Ray workers and subprocesses inherit it), and the tests of the bf16 branch say
`native` themselves.
"""

from __future__ import annotations

import os
import sys

_VENV_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

os.environ["BERTFORGE_CPU_BF16"] = "emulated"

# Longest first, as measured on a 2-core machine (seconds, whole module). A module not listed
# keeps its place after these, in collection order.
SLOWEST_MODULES = (
    # Seconds of a clean clone's `make test` on 2 AVX2 cores (2026-11-26), longest first.
    "tests/cluster/test_fault_tolerance.py",   # ~185: a Ray Train run, two restarts; a user error
    "tests/cluster/test_train_from_outside.py",  # ~170: a train SIGTERMed, resumed; eval, export
    "tests/cluster/test_pipeline.py",          # ~165: Beam + two Ray Train phases + export
    "tests/cluster/test_submit.py",            # ~100: `ray start` x2 + four jobs
    "tests/cluster/test_finetune.py",          # ~100
    "tests/cluster/test_demo_e2e.py",          # ~90: the demo, smaller
    # ~95 on 2 Intel Xeon cores without AVX512-BF16 (2026-11-28): the README's commands on a
    # clone; unlisted until then, it could start last and run alone.
    "tests/cluster/test_readme_on_a_clone.py",
    # ~75 in a fresh clone's run; ~15 alone in a checkout that ran it before (inductor keeps
    # the C++ kernels it compiled).
    "tests/training/test_compile.py",
    "tests/training/test_elastic_resume.py",   # ~60: runs in spawned process groups
    # ~60 cold on 2 Intel Xeon cores without AVX512-BF16 (2026-11-28): two compiled paths.
    "tests/training/test_gradient_fidelity_script.py",
    "tests/training/test_gpu_throughput_script.py",  # ~70 (2026-11-27): a dozen short runs
    "tests/cluster/test_dataset_guard.py",     # ~50: prepare through the CLI, a SIGTERM
    "tests/training/test_compile_cache.py",    # ~50: two cold compiles at two CPU levels
    "tests/training/test_fp8.py",              # ~50 (2026-11-28, as test_readme_on_a_clone)
    "tests/training/test_fast_path.py",        # ~40 (the same)
    "tests/training/test_loop.py",             # ~35 (the same)
    "tests/cluster/test_clean_exit.py",        # ~50
    "tests/pipelines/test_prepare.py",         # ~40
    "tests/training/test_same_seed.py",        # ~35: 8 short runs in process groups
    "tests/test_packaging.py",                 # ~35: wheel, fresh venvs
    "tests/pipelines/test_real_data.py",       # ~35
    "tests/pipelines/test_prepare_any_size.py",  # ~35: prepare spilled, killed, continued
    "tests/cluster/test_local_worker.py",      # ~30: a local fine-tune, its worker killed
    "tests/training/test_gpu_proof_script.py",  # ~20
    "tests/pipelines/test_quiet_harness.py",   # ~15: a local prepare on 2 worker processes
    "tests/cluster/test_glue.py",              # ~10
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: index for index, path in enumerate(SLOWEST_MODULES)}
    # sort is stable: the tests of a module, and the unlisted modules, keep their order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
