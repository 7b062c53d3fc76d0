"""Counting the aten operations a piece of code dispatches: on a GPU each one that computes is
a kernel launch, so a count on a CPU tells how much host work a step asks for."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as counted:` ...; `counted.ops` maps an operation's name to a count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
