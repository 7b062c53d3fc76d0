"""Stage 0 on several ranks reduces the gradients in buckets during the backward
(training.gradient_buckets), with DeepSpeed's arithmetic: two CPU ranks (gloo) train the same
steps through it and through DeepSpeed's own stage-0 reduction, with accumulation."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.local_cluster import as_local_rank, free_port
from tests.support.op_counts import OpCounter

MICRO_STEPS = 6  # 3 optimizer steps of 2 micro-batches a rank
SMALL_BUCKET = 6_000  # fp32 elements: the narrow model's 58 tensors fill about 12 buckets


def _batch(rank: int, micro_step: int) -> dict[str, torch.Tensor]:
    from bertforge.training.model import IGNORE_INDEX

    generator = torch.Generator().manual_seed(1000 * rank + micro_step)
    ids = torch.randint(5, 500, (2, 16), generator=generator)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 3:7] = ids[:, 3:7]
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
            "attention_mask": torch.ones_like(ids), "labels": labels,
            "next_sentence_label": torch.tensor([0, 1])}


BUCKETS, SET_TO_NONE, DEEPSPEED = "buckets", "buckets, .grad set to None", "deepspeed"
# The same two reductions of a model with a parameter no backward reaches, and of compiled
# encoder layers (the GPU's default: their gradients come out of AOTAutograd's backward).
UNUSED_BUCKETS, UNUSED_DEEPSPEED = "buckets, an unused parameter", "deepspeed, an unused parameter"
COMPILED_BUCKETS, COMPILED_DEEPSPEED = "buckets, compiled layers", "deepspeed, compiled layers"
# Each run of the buckets and the DeepSpeed run it must equal.
TWIN = {BUCKETS: DEEPSPEED, SET_TO_NONE: DEEPSPEED, UNUSED_BUCKETS: UNUSED_DEEPSPEED,
        COMPILED_BUCKETS: COMPILED_DEEPSPEED}


def _wait_for(path: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)


def _train(rank: int, precision: str, reduction: str, compiled_flag: str) -> dict:
    """MICRO_STEPS micro-steps of the default engine on this rank's batches; what a test checks:
    the final weights, the all-reduces started per micro-step and how many gradients the
    backward had accumulated when each started, and the boundary micro-step's operations.
    SET_TO_NONE: the buckets, and after each optimizer step `model.zero_grad()` (torch's
    default set_to_none), as a user's code might call it. UNUSED_*: the model has a head the
    loss never reaches, registered last, so its gradient is in the first bucket."""
    import bertforge.training.engine as engine_module
    import bertforge.training.gradient_buckets as gradient_buckets
    from bertforge.training.config import TrainConfig
    from bertforge.training.model import BertConfig, BertForPreTraining
    from bertforge.training.resolved_engine import resolve_engine

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=4,
                                          num_attention_heads=2, intermediate_size=64))
    if reduction in (UNUSED_BUCKETS, UNUSED_DEEPSPEED):
        model.unused_head = torch.nn.Linear(4, 4)
    compiled = reduction in (COMPILED_BUCKETS, COMPILED_DEEPSPEED)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiled so far
    cfg = TrainConfig(data_dir="d", run_dir="r", precision=precision, micro_batch_size=2,
                      global_batch_size=8, max_steps=10, warmup_steps=2, compile=compiled)
    reduce_in_buckets = engine_module.reduce_in_buckets
    if reduction in TWIN.values():  # DeepSpeed's own reduction, after the backward
        engine_module.reduce_in_buckets = lambda engine: None
    gradient_buckets.BUCKET_NUMEL = SMALL_BUCKET
    try:
        engine = engine_module.build_engine(model, resolve_engine(cfg.engine(), 2))
    finally:
        engine_module.reduce_in_buckets = reduce_in_buckets
    assert engine.zero_optimization_stage() == 0 and engine.gradient_accumulation_steps() == 2
    parameters = list(model.parameters())
    initial = [p.detach().clone() for p in parameters]
    accumulated = [0]  # gradients accumulated so far in this backward
    for p in parameters:  # after the buckets' own hooks
        p.register_post_accumulate_grad_hook(
            lambda p: accumulated.__setitem__(0, accumulated[0] + 1))
    started: list[list[int]] = []  # per micro-step: `accumulated` as each all-reduce started
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        started[-1].append(accumulated[0])
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        for micro_step in range(MICRO_STEPS):
            # Rank 1 compiles after rank 0, from inductor's cache: the same graphs, built once
            # on a fresh machine. Safe to wait: an accumulating micro-step has no collective.
            if compiled and micro_step == 0 and rank == 1:
                _wait_for(compiled_flag)
            started.append([])
            accumulated[0] = 0
            batch = _batch(rank, micro_step)
            # Under a dispatch mode dynamo would leave the layers eager: compiled runs are
            # not counted.
            with nullcontext(OpCounter()) if compiled else OpCounter() as counted:
                engine.backward(engine(**batch)["loss"])
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
            if reduction == SET_TO_NONE and boundary:
                model.zero_grad()  # after the optimizer's step
            if compiled and micro_step == 0 and rank == 0:
                open(compiled_flag, "w").close()
    finally:
        dist.all_reduce = all_reduce
    result = {"weights": [p.detach().clone() for p in parameters], "initial": initial,
              "started": started,
              "boundary_ops": counted.ops, "num_tensors": len(parameters),
              "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs}
    if reduction == BUCKETS:
        storages = {b.untyped_storage().data_ptr() for b in engine.gradient_buckets.buckets}
        result["num_buckets"] = len(storages)
        result["grads_in_buckets"] = all(p.grad.untyped_storage().data_ptr() in storages
                                         for p in parameters)
    engine.destroy()
    return result


def _rank(rank: int, port: int, out: str) -> None:
    as_local_rank(rank, 2, port)
    from bertforge.training.engine import ensure_process_group

    ensure_process_group()
    runs = [(precision, reduction) for precision in ("fp32", "bf16")
            for reduction in (BUCKETS, DEEPSPEED)] + [
        ("fp32", reduction) for reduction in (SET_TO_NONE, UNUSED_BUCKETS, UNUSED_DEEPSPEED)] + [
        ("bf16", reduction) for reduction in (COMPILED_BUCKETS, COMPILED_DEEPSPEED)]
    results = {run: _train(rank, *run, compiled_flag=out + ".compiled") for run in runs}
    # Every rank ends with the same weights (checked on rank 0 against rank 1's).
    theirs = [None, None]
    dist.all_gather_object(theirs, {key: r["weights"] for key, r in results.items()})
    if rank == 0:
        torch.save({"results": results, "rank1_weights": theirs[1]}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("buckets") / "results.pt")
    mp.spawn(_rank, args=(free_port(), out), nprocs=2)
    return torch.load(out)


@pytest.mark.parametrize("precision, reduction", [("fp32", BUCKETS), ("bf16", BUCKETS),
                                                  ("fp32", SET_TO_NONE),
                                                  ("bf16", COMPILED_BUCKETS)])
def test_the_buckets_train_the_weights_deepspeeds_reduction_trains(two_ranks, precision,
                                                                   reduction):
    """Bit for bit: the same fp32 sums over two ranks, the same multiply by 1/2, the same
    clip and AdamW, over 3 optimizer steps of 2 accumulated micro-batches (bf16: under
    autocast, whose gradients are fp32 too); also where something sets the gradients to None
    between steps (autograd's new tensors go back into the buckets), and with compiled
    layers, as on a GPU. Two ranks cannot tell a
    multiply before the sum from one after it (x 0.5 is exact): the code multiplies after, as
    DeepSpeed does."""
    if reduction == COMPILED_BUCKETS:  # the layers did compile (their twin, run next in the
        # same process, reuses the graphs: parameters are graph inputs)
        assert two_ranks["results"][(precision, reduction)]["graphs"] > 0
    ours = two_ranks["results"][(precision, reduction)]["weights"]
    deepspeeds = two_ranks["results"][(precision, TWIN[reduction])]["weights"]
    initial = two_ranks["results"][(precision, reduction)]["initial"]
    # Every tensor trained (a match of untrained weights would prove nothing).
    assert not any(torch.equal(a, b) for a, b in zip(ours, initial, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours, deepspeeds, strict=True))
    assert all(torch.equal(a, b) for a, b in
               zip(ours, two_ranks["rank1_weights"][(precision, reduction)], strict=True))


def test_buckets_start_during_the_backward_and_only_at_the_accumulation_boundary(two_ranks):
    result = two_ranks["results"][("fp32", BUCKETS)]
    started, num_tensors = result["started"], result["num_tensors"]
    assert result["num_buckets"] > 5
    # No collective on the micro-steps that accumulate; one a bucket at each boundary.
    assert [len(s) for s in started] == [0, result["num_buckets"]] * (MICRO_STEPS // 2)
    for boundary in started[1::2]:
        # The first bucket starts while most of the backward is still to come, in order.
        assert boundary[0] < num_tensors // 4, boundary
        assert boundary == sorted(boundary)
    # DeepSpeed's reduction starts only after every gradient is in.
    deepspeeds = [n for s in two_ranks["results"][("fp32", DEEPSPEED)]["started"] for n in s]
    assert deepspeeds and set(deepspeeds) == {num_tensors}


def test_a_parameter_without_gradient_holds_its_bucket_and_those_after_it(two_ranks):
    """A bucket waiting for a gradient that never comes starts when the backward ends, and the
    buckets after it with it (collectives start in the same order on every rank): late, but
    the same arithmetic as DeepSpeed's, which reduces the unused parameter's zeros too."""
    ours = two_ranks["results"][("fp32", UNUSED_BUCKETS)]
    deepspeeds = two_ranks["results"][("fp32", UNUSED_DEEPSPEED)]
    assert all(torch.equal(a, b)
               for a, b in zip(ours["weights"], deepspeeds["weights"], strict=True))
    used = ours["num_tensors"] - 2  # the unused head's weight and bias
    boundaries = ours["started"][1::2]
    assert boundaries and all(len(s) > 5 and set(s) == {used} for s in boundaries)


def test_the_gradients_stay_in_the_buckets_and_nothing_is_copied_back(two_ranks):
    ours = two_ranks["results"][("fp32", BUCKETS)]
    deepspeeds = two_ranks["results"][("fp32", DEEPSPEED)]
    assert ours["grads_in_buckets"]  # after 3 optimizer steps and their zero_grad
    # DeepSpeed copies every reduced gradient back out of its flat buffer; the buckets are
    # the gradients.
    assert deepspeeds["boundary_ops"]["copy_"] >= deepspeeds["num_tensors"]
    assert ours["boundary_ops"].get("copy_", 0) == 0
    # No read to the host either (the model's own, a CPU-only padding check, aside).
    assert (ours["boundary_ops"]["_local_scalar_dense"]
            == deepspeeds["boundary_ops"]["_local_scalar_dense"])


def test_buckets_laid_out_again_for_a_model_take_its_gradients_over():
    """An engine built again on the same model (one rank here): the newer buckets hold the
    gradients, the older ones let go instead of pulling each gradient back into theirs."""
    from bertforge.training.engine import ensure_process_group
    from bertforge.training.gradient_buckets import GradientBuckets
    from bertforge.training.model import BertConfig, BertForPreTraining

    ensure_process_group()
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64))
    batch = _batch(0, 0)
    torch.manual_seed(1)  # the same dropout masks in both backwards
    model(**batch).loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    older = GradientBuckets(model, lambda: True)
    newer = GradientBuckets(model, lambda: True)
    torch.manual_seed(1)
    model(**batch).loss.backward()
    storages = {b.untyped_storage().data_ptr() for b in newer.buckets}
    assert all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))
    assert not any(bucket.any() for bucket in older.buckets)
