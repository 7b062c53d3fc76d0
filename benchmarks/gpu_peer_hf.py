"""The transformers peer of gpu_throughput.py: Hugging Face `BertForPreTraining` on one device.

What a user would run instead of bertforge: transformers' model (BERT-large shape, SDPA
attention), fp32 weights under `torch.autocast(bf16)`, torch's fused AdamW (lr 1e-4, betas
(0.9, 0.98), weight decay 0.01), `clip_grad_norm_` at 1.0 and `zero_grad(set_to_none=True)`:
what HF's Trainer does with `bf16=True`. Eager, or with `--compile` the model under
`torch.compile` (the optimizer step stays eager, as in the Trainer).

Batches: the same synthetic ones as gpu_throughput.py's (`tests/support/synthetic.py`, seed
12345: Google's length rule, the loader's masking and padding), `--num-batches` of them moved to
the device before timing and cycled. The model's dense MLM head scores every position (HF has
no sparse head), which is part of what is compared.

Timing as gpu_throughput.py's: `--warmup` untimed steps (their seconds, compilation included,
are reported as `warmup_s`), then `--steps` steps, each ended by a device synchronize; the
median and fastest step, and rates over the total timed time. Peak memory is over the timed
steps. One JSON line per sequence length is printed; `--out` gets the list. No DeepSpeed and no
bertforge engine: `run_peer(argv)` can be imported and called from another script (see
gpu_profile.py, which profiles this step).

    python benchmarks/gpu_peer_hf.py --out /tmp/peer.json                  # large, 128 and 512
    python benchmarks/gpu_peer_hf.py --compile --seq-lens 128 --out /tmp/peer_compiled.json
    CUDA_VISIBLE_DEVICES= python benchmarks/gpu_peer_hf.py --device cpu --config tiny \\
        --seq-lens 128 --micro-batch 4 --steps 2 --warmup 1 --out /tmp/peer.json   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `tests.support` (helpers shared with the tests, never installed) from this checkout, as
# gpu_throughput.py does.
sys.path.insert(0, REPO)

VOCAB_SIZE = 30522
SEED = 12345  # gpu_throughput.py's default --seed: the same batches
# transformers.BertConfig fields; `tiny` is for a CPU smoke run only.
SHAPES = {
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=512),
}
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(SHAPES), default="large", help="model shape")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seq-lens", default="128,512", help="comma-separated")
    parser.add_argument("--micro-batch", default=None,
                        help="one value, or one per sequence length (default: 32,768 tokens, "
                             "256 at 128, 64 at 512)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per sequence length")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed steps first (with --compile, keep it >= --num-batches so "
                             "that every batch width compiles before timing)")
    parser.add_argument("--num-batches", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--compile", action="store_true", help="the model under torch.compile")
    parser.add_argument("--out", default=None, help="JSON file for the list of results")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.num_batches < 1:
        parser.error("--steps and --num-batches must be >= 1, --warmup >= 0")
    return args


def plan_cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(sequence length, micro-batch) pairs, by gpu_throughput.py's rule."""
    from tests.support.synthetic import micro_batches

    lengths = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    return list(zip(lengths, micro_batches(lengths, args.micro_batch), strict=True))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Peer:
    """One built peer: `step(i)` runs a full training step on batch i (cycled), no synchronize."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[dict[str, torch.Tensor]]
    step: Callable[[int], torch.Tensor]
    device: str
    compiled: bool
    attn_implementation: str | None


def build_peer(config: str, seq_len: int, micro_batch: int, device: str, compile: bool,
               num_batches: int = 8) -> Peer:
    """Model, optimizer and batches on `device`, and the step function over them."""
    from transformers import BertConfig, BertForPreTraining

    from tests.support.synthetic import synthetic_batches

    batches = [{k: v.to(device) for k, v in b.items()}
               for b in synthetic_batches(num_batches, micro_batch, seq_len, VOCAB_SIZE,
                                          seed=SEED)]
    torch.manual_seed(SEED)
    hf_config = BertConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                           attn_implementation="sdpa", **SHAPES[config])
    model = BertForPreTraining(hf_config).to(device).train()  # fp32 weights; autocast does bf16
    # fused=True: one kernel for the whole update on a GPU (torch has a fused CPU path too).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98),
                                  weight_decay=0.01, fused=True)
    if compile and device == "cpu":
        # Inductor's CPU kernel cache is not keyed by the CPU's vector level (see the module).
        from bertforge.training.compile_cache import use_cache_per_cpu_level

        use_cache_per_cpu_level()
    forward = torch.compile(model) if compile else model

    def step(i: int) -> torch.Tensor:
        b = batches[i % len(batches)]
        with torch.autocast(device, dtype=torch.bfloat16):
            out = forward(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                          attention_mask=b["attention_mask"], labels=b["labels"],
                          next_sentence_label=b["next_sentence_label"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    return Peer(model, optimizer, batches, step, device, compile,
                getattr(model.config, "_attn_implementation", None))


def release(peer: Peer | None) -> None:
    """Free what a peer holds, so that the next case starts from an empty device."""
    compiled = peer is not None and peer.compiled
    if peer is not None:
        peer.batches.clear()
        peer.model = peer.optimizer = peer.step = None  # the step's closure holds them too
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # drops the compiled graphs (and the parameters they hold)
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(peer: Peer, warmup: int, steps: int) -> dict[str, Any]:
    """Warm up, then time `steps` synchronized steps."""
    started = time.perf_counter()
    for i in range(warmup):
        peer.step(i)
    synchronize(peer.device)
    warmup_s = time.perf_counter() - started
    if peer.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    # As ours (bertforge's training/host_gc.py, written out here: the peer imports nothing of
    # bertforge, as a user's script would not): what is alive after warm-up is frozen and the
    # collector starts no full pass of its own, so that none falls inside a timed step of
    # either side and the ratio compares models and engines, not when Python's collector ran.
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 2**31 - 1)
    try:
        for i in range(warmup, warmup + steps):
            started = time.perf_counter()
            losses.append(peer.step(i))
            synchronize(peer.device)
            seconds.append(time.perf_counter() - started)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    real_tokens = sum(int(peer.batches[i % len(peer.batches)]["attention_mask"].sum())
                      for i in range(warmup, warmup + steps))
    micro_batch = peer.batches[0]["input_ids"].shape[0]
    return {
        "warmup_s": warmup_s, "timed_seconds": sum(seconds),
        "step_ms_median": 1e3 * statistics.median(seconds), "step_ms_min": 1e3 * min(seconds),
        "sequences_per_s": micro_batch * steps / sum(seconds),
        "real_tokens_per_s": real_tokens / sum(seconds),
        "loss_first": losses[0].item(), "loss_last": losses[-1].item(),
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / GIB
                            if peer.device == "cuda" else None),
    }


def run_peer(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Every sequence length of `argv` (this script's options): one result dict each."""
    import transformers

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu (e.g. --config tiny)")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = []
    for seq_len, micro_batch in plan_cases(args):
        peer = build_peer(args.config, seq_len, micro_batch, args.device, args.compile,
                          args.num_batches)
        result = {
            "peer": "transformers BertForPreTraining", "transformers": transformers.__version__,
            "torch": torch.__version__, "device": device_name, "config": args.config,
            "attn_implementation": peer.attn_implementation, "precision": "bf16 autocast",
            "optimizer": "torch AdamW fused", "compile": args.compile, "seq_len": seq_len,
            "micro_batch": micro_batch, "warmup": args.warmup, "steps": args.steps,
            **measure(peer, args.warmup, args.steps),
        }
        print(json.dumps(result), flush=True)
        results.append(result)
        release(peer)
        del peer
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    run_peer()
