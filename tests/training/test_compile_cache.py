"""`compile_cache`: a compiled run under another CPU vector level than the cache's never loads
kernels built for the other level (inductor's cache keys leave the level out)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bertforge.training.compile_cache import CACHE_DIR_VARIABLE, use_cache_per_cpu_level

# What `engine.compile()` does, on a graph small enough to compile in seconds. It has a
# vectorised loop, which is what breaks: kernels written for AVX2, rebuilt without it.
COMPILE_ONCE = """
import torch
from bertforge.training.compile_cache import use_cache_per_cpu_level
folder = use_cache_per_cpu_level()
step = torch.compile(lambda x: torch.relu(x * 2.0 + 1.0).sum(dim=-1), dynamic=False)
total = step(torch.arange(256, dtype=torch.float32).reshape(4, 64)).sum().item()
print(folder, torch.backends.cpu.get_cpu_capability(), total)
"""


def test_the_cache_folder_is_the_cpu_levels_own_unless_the_user_chose_one(monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    folder = use_cache_per_cpu_level()
    assert os.path.dirname(os.path.dirname(folder)) == str(tmp_path)
    assert os.path.basename(os.path.dirname(folder)).startswith("torchinductor_")
    assert os.path.basename(folder).startswith("cpu_") and folder == os.environ[CACHE_DIR_VARIABLE]
    assert use_cache_per_cpu_level() == folder  # its own setting is not taken for a choice

    monkeypatch.setenv(CACHE_DIR_VARIABLE, os.path.dirname(folder))  # what inductor writes
    assert use_cache_per_cpu_level() == folder

    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "mine"))
    assert use_cache_per_cpu_level() == str(tmp_path / "mine")
    assert os.environ[CACHE_DIR_VARIABLE] == str(tmp_path / "mine")


@pytest.mark.slow
def test_a_run_at_a_capped_cpu_level_compiles_after_one_at_the_full_level():
    """The README's capped run (ATEN_CPU_CAPABILITY) after a plain one, on one machine, in the
    temporary directory's inductor cache, as a user's runs share it. Without a folder per level
    the second fails: `CppCompileError ... 'at::vec' has not been declared` (torch 2.13): the
    FX graph cache, keyed without the level, hands it the first one's kernels, whether or not
    either was cached before. (A TMPDIR of the test's own, cold, cost ~15 s more on a fresh
    machine: inductor's start-up builds again there, the full level's too.)"""
    env = {k: v for k, v in os.environ.items() if k != CACHE_DIR_VARIABLE}
    seen = []
    for level in (None, "default"):
        run_env = dict(env, ATEN_CPU_CAPABILITY=level) if level else env
        done = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=run_env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(done.stdout.split())
    (full_folder, full_level, full_total), (capped_folder, capped_level, capped_total) = seen
    assert capped_level == "DEFAULT" and capped_folder.endswith("cpu_default")
    assert full_folder.endswith(f"cpu_{full_level.lower()}")
    assert float(full_total) == float(capped_total) == sum(max(2.0 * i + 1.0, 0) for i in
                                                           range(256))
