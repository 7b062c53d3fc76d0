"""Host work of one whole training step on two ranks, per ZeRO stage (issue 34, several GPUs).

No GPU here has more than one device, so the multi-GPU default is chosen by what a step asks of
the host: two CPU ranks (gloo) train BERT-large's 24 layers (302 parameter tensors) at tiny's
width in bf16, and one whole step (forward, backward with DeepSpeed's gradient reduction,
optimizer step; the third, past the optimizer state's creation) is counted by aten operation
on rank 0. "Computing" leaves out views, aliases and allocations, which launch no kernel on a
GPU; "host reads" are `.item()`-style copies to the host, each a sync on a GPU; "copies" are
`copy_` calls (DeepSpeed's stage-0 reduction copied each gradient back out of its flat buffer);
"all-reduces" the collectives started. The totals are
whole steps, the model's operations included, and those differ a little between stages too
(at stage 0 autocast casts each weight to bf16 in the forward; at 1-3 the model is bf16): read
the differences as net.

    .venv/bin/python benchmarks/step_ops_on_two_ranks.py [--stages 0 1 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests.support: the op counter the fast path's test uses

from tests.support.local_cluster import as_local_rank, free_port  # noqa: E402
from tests.support.op_counts import OpCounter  # noqa: E402

# Operations that launch no kernel on a GPU (views, aliases, allocations) or read to the host.
NOT_COMPUTING = {
    "view", "detach", "t", "transpose", "slice", "as_strided", "_unsafe_view", "expand",
    "alias", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "reshape",
    "select", "unbind", "_reshape_alias", "narrow", "empty", "empty_like", "empty_strided",
    "lift_fresh", "_local_scalar_dense", "is_nonzero", "chunk",
}


def _rank(rank: int, port: int, stage: int, out: str) -> None:
    as_local_rank(rank, 2, port)
    os.environ["BERTFORGE_CPU_BF16"] = "native"
    from bertforge.training.config import TrainConfig
    from bertforge.training.engine import build_engine, ensure_process_group
    from bertforge.training.model import IGNORE_INDEX, BertConfig, BertForPreTraining
    from bertforge.training.resolved_engine import resolve_engine

    ensure_process_group()
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=24,
                                          num_attention_heads=2, intermediate_size=64))
    model.max_predictions = 3  # as the loop sets it from the loader: no read of the widest row
    cfg = TrainConfig(data_dir="d", run_dir="r", precision="bf16", micro_batch_size=2,
                      max_steps=10, warmup_steps=2, compile=False, zero_stage=stage)
    engine = build_engine(model, resolve_engine(cfg.engine(), 2))
    ids = torch.randint(5, 500, (2, 16))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 3:6] = ids[:, 3:6]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
             "attention_mask": torch.ones_like(ids), "labels": labels,
             "next_sentence_label": torch.zeros(2, dtype=torch.long)}
    for _ in range(3):
        with OpCounter() as counted:
            engine.backward(engine(**batch)["loss"])
            engine.step()
    if rank == 0:
        ops = counted.ops
        torch.save({"optimizer": type(engine.optimizer).__name__,
                    "tensors": len(list(model.parameters())), "all": sum(ops.values()),
                    "computing": sum(n for op, n in ops.items() if op not in NOT_COMPUTING),
                    "host_reads": ops["_local_scalar_dense"],
                    "per_tensor_norms": ops["linalg_vector_norm"], "copies": ops["copy_"],
                    "all_reduces": sum(n for op, n in ops.items() if "allreduce" in op)}, out)
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1], choices=(0, 1, 2, 3))
    args = parser.parse_args()
    print("| ZeRO stage | optimizer | parameter tensors | aten ops a step | computing | "
          "host reads | vector norms | copies | all-reduces |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for stage in args.stages:
            out = os.path.join(scratch, f"stage{stage}.pt")
            mp.spawn(_rank, args=(free_port(), stage, out), nprocs=2)
            r = torch.load(out)
            print(f"| {stage} | {r['optimizer']} | {r['tensors']} | {r['all']:,} | "
                  f"{r['computing']:,} | {r['host_reads']} | {r['per_tensor_norms']} | "
                  f"{r['copies']} | {r['all_reduces']} |",
                  flush=True)


if __name__ == "__main__":
    main()
