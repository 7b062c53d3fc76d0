"""One torch.compile kernel cache per CPU vector level, so kernels built for one never load
under another.

Inductor keys its on-disk caches (FX graph, AOT autograd) without the CPU vector ISA it wrote
its C++ for. So a graph cached under one level, then loaded under another, has its kernels
rebuilt with the new level's flags, and the build fails. The level changes when
`ATEN_CPU_CAPABILITY` caps it (the README's way to run the suite as an AVX2-only machine would)
or when another CPU kind shares the folder. Seen with torch 2.13 on the 2-core AVX2 EPYC: a
`--compile` run, then the same with `ATEN_CPU_CAPABILITY=default`: `CppCompileError ...
'at::vec' has not been declared`. A fresh folder for that level compiles and trains.
"""

from __future__ import annotations

import os

import torch

CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def use_cache_per_cpu_level() -> str:
    """Point inductor at a folder of this CPU level's own (cpu_avx2, cpu_avx512, cpu_default)
    inside its default one; a folder the user chose is kept as it is. Returns the folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.path.abspath(os.environ.get(CACHE_DIR_VARIABLE) or default)
    # Inductor writes its default into the variable once it used it, and so does this
    # function its own folder: neither is the user's choice.
    ours = os.path.dirname(chosen) == default and os.path.basename(chosen).startswith("cpu_")
    if chosen != default and not ours:
        return chosen
    level = torch.backends.cpu.get_cpu_capability().lower()
    os.environ[CACHE_DIR_VARIABLE] = os.path.join(default, f"cpu_{level}")
    return os.environ[CACHE_DIR_VARIABLE]
