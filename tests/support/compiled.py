"""torch.compile in a test as the engine compiles: inductor's on-disk cache kept per CPU vector
level (`training.compile_cache`, what build_engine does). The suite also runs capped to AVX2,
and code cached for another level is not this level's (DESIGN.md, "Dependency facts")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bertforge.training.compile_cache import use_cache_per_cpu_level


def compiled(function: Callable) -> Callable:
    """`function` under torch.compile in one graph (a graph break fails the call)."""
    use_cache_per_cpu_level()
    return torch.compile(function, fullgraph=True)
