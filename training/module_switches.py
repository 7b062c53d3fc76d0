"""One switch set on every module of a kind in a model: the per-module flags that choose a
code path (FP8 GEMMs, the residual stream's dtype, the benchmark's experiments). Set before
compiling: a compiled layer keeps what it was traced with until it recompiles."""

from __future__ import annotations

from torch import nn


def switch_every(model: nn.Module, kind: type[nn.Module], attribute: str, enabled: bool) -> None:
    """`attribute` = `enabled` on every module of `model` that is a `kind`."""
    for module in model.modules():
        if isinstance(module, kind):
            setattr(module, attribute, bool(enabled))
