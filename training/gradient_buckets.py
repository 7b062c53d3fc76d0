"""ZeRO stage 0 on several ranks: gradients in flat buckets, each all-reduced as soon as the
backward has filled it, while the backward goes on.

DeepSpeed 0.19's stage-0 reduction (`DeepSpeedEngine.allreduce_gradients`) starts only after
the whole backward: it flattens every gradient into a new buffer (BERT-large: 1.34 GB of fp32,
a second copy), all-reduces it, and copies it back tensor by tensor (302 copies), then
`zero_grad` sets each `.grad` to None in a Python loop. Nothing overlaps: with no accumulation
(BERT-large at 4,096 sequences on 8 x 512) every step waits for the whole all-reduce, which
across nodes is tens of milliseconds of a ~350 ms step.

Here, as in torch's DDP and Megatron-LM's gradient buffers, each parameter's `.grad` is a view
into one of a few flat fp32 buckets, laid out in the reverse of the parameters' registration
order (about the order the backward produces them: heads, last layer, ..., embeddings). On the
micro-step that ends an accumulation, a hook after each gradient's accumulation counts the
bucket down, and a full bucket is all-reduced at once (`async_op`: on NCCL the collective runs
on its own stream while the backward computes the next layers). Buckets start in their order
on every rank, as collectives must; one waiting for a gradient holds back those after it, never
the other way round. When the backward ends, the rest start (the buckets of parameters this
backward gave no gradient: their zeros), the device waits for them (a stream wait on NCCL, not
a host sync) and one multi-tensor multiply turns the sums into means. Nothing is copied (but a
gradient something has set to None, which goes back into its bucket), nothing is read to the
host, and `zero_grad` is one multi-tensor `zero_`.

The arithmetic is DeepSpeed's: the sum over ranks of the fp32 gradients, then a multiply by
1 / world size (tests/training/test_gradient_buckets.py holds it to DeepSpeed's own reduction,
bit for bit).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# fp32 elements a bucket holds before the next parameter starts a new one: 100 MB, 15 buckets
# for BERT-large's 335M parameters. Larger buckets start later; smaller ones cost NCCL more per
# byte (torch's DDP takes 25 MB, Megatron-LM ~40M elements).
BUCKET_NUMEL = 25_000_000

# The GradientBuckets that holds each model's gradients now.
_OWNER: weakref.WeakKeyDictionary[torch.nn.Module, GradientBuckets] = weakref.WeakKeyDictionary()


class GradientBuckets:
    """Holds the `.grad` of `model`'s trainable parameters (all on one device) as views into
    flat buckets and all-reduces them, overlapped with the backward, when `is_sync_step()`
    says so at the forward before it."""

    def __init__(self, model: torch.nn.Module, is_sync_step: Callable[[], bool]) -> None:
        self.world_size = dist.get_world_size()
        parameters = [p for p in model.parameters() if p.requires_grad]
        # Each parameter's bucket and its gradient's view into it.
        self.buckets, self._slot_of = _lay_out(list(reversed(parameters)), BUCKET_NUMEL)
        per_bucket = Counter(index for index, _ in self._slot_of.values())
        self._sizes = [per_bucket[index] for index in range(len(self.buckets))]  # parameters
        self._is_sync_step = is_sync_step
        # This backward's state, set at its forward: whether it all-reduces, each bucket's
        # parameters still to accumulate, the all-reduces started (in bucket order).
        self._syncing = False
        self._pending = list(self._sizes)
        self._started: list[Any] = []
        self._finish_queued = False
        # One owner of a model's gradients: buckets laid out before for this model (an engine
        # built again on it) let go of it, or their hooks would pull each gradient back.
        previous = _OWNER.get(model)
        if previous is not None:
            previous._let_go()
        _OWNER[model] = self
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                       for p in self._slot_of]
        self._hooks.append(model.register_forward_pre_hook(self._before_forward))

    def _let_go(self) -> None:
        for hook in self._hooks:
            hook.remove()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """The engine's zero_grad: the gradients stay views of the buckets."""
        torch._foreach_zero_(self.buckets)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # The engine's micro-step counter moves in `step()`, after this forward's backward:
        # what it says now holds for that backward.
        self._syncing = torch.is_grad_enabled() and self._is_sync_step()
        self._pending = list(self._sizes)
        self._started = []
        self._finish_queued = False

    def _accumulated(self, parameter: torch.Tensor) -> None:
        index, view = self._slot_of[parameter]
        if parameter.grad is not view:
            # Something set `.grad` to None (a module's or an optimizer's zero_grad, whose
            # default is set_to_none) and autograd made a new tensor for this backward's
            # gradient: into the bucket it goes, as torch's DDP does, or the bucket would
            # all-reduce stale values while this rank stepped on its own gradient.
            with torch.no_grad():
                view.copy_(parameter.grad)
            parameter.grad = view
        if not self._syncing:
            return
        if not self._finish_queued:
            # Runs once the whole backward is done, on the thread that ran it, with the
            # caller's stream current. One graph task a backward: the model's activation
            # checkpointing is non-reentrant (a reentrant one would end an inner backward
            # first and run this too early). A backward that reached no parameter would queue
            # nothing and leave the other ranks waiting: BERT's losses always reach them.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        self._pending[index] -= 1
        while len(self._started) < len(self.buckets) and not self._pending[len(self._started)]:
            self._start(len(self._started))

    def _start(self, index: int) -> None:
        self._started.append(dist.all_reduce(self.buckets[index], async_op=True))

    def _finish(self) -> None:
        while len(self._started) < len(self.buckets):
            self._start(len(self._started))
        for work in self._started:
            work.wait()
        torch._foreach_mul_(self.buckets, 1.0 / self.world_size)
        self._syncing = False


def _lay_out(parameters: list[torch.Tensor], bucket_numel: int) -> tuple[
        list[torch.Tensor], dict[torch.Tensor, tuple[int, torch.Tensor]]]:
    """Zeroed flat buckets in `parameters`' order, each parameter's `.grad` a view into one;
    and for each parameter, its bucket's index and that view.
    A bucket closes before the parameter that would take it past `bucket_numel` (a parameter
    larger than that has one of its own) or that has another dtype."""
    groups: list[list[torch.Tensor]] = []
    numel = 0  # in the last group
    for p in parameters:
        if not groups or groups[-1][0].dtype != p.dtype or numel + p.numel() > bucket_numel:
            groups.append([])
            numel = 0
        groups[-1].append(p)
        numel += p.numel()
    buckets, slot_of = [], {}
    for index, group in enumerate(groups):
        bucket = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                             device=group[0].device)
        offset = 0
        for p in group:
            p.grad = bucket[offset:offset + p.numel()].view_as(p)
            slot_of[p] = (index, p.grad)
            offset += p.numel()
        buckets.append(bucket)
    return buckets, slot_of
