"""Issue 34, item 4 at fixed weights: how close each precision path's loss and gradients come to
fp64's, every path on the same weights and the same batches.

`gpu_parity.py` compares loss curves over 100 steps in which each path trains its own weights.
Those part by more than any one step's rounding once the learning rate peaks: the runs amplify
small differences (on the H200, FP8 came out closer to fp32 than bf16 did; benchmarks/README.md,
"Issue 34"). Here nothing is trained: each path computes the loss and the gradients of one set
of weights on each of `--batches` real micro-batches, and each is compared with fp64 eager's.
The weights are the model's initialisation, a checkpoint's (`--init-from`), or either after
`--train-steps` steps of the fast path's arithmetic on other batches (past the warm-up, where
the parity runs' curves part).
What differs is the arithmetic alone:

- `fp64`: the reference, eager;
- `fp32`: eager, fp32 throughout (no TF32);
- `bf16 eager`: fp32 weights under bf16 torch.autocast, the residual stream in bf16 (the fast
  path uncompiled);
- `bf16 compiled`: the fast path as the engine runs it (its compiled layers, with the engine's
  inductor options);
- `bf16 compiled, fp32 residual`: the same with the residual stream in fp32;
- `bf16 weights`: the model in bf16, eager (the arithmetic of DeepSpeed's bf16 model under
  ZeRO, the path before the fast path; LayerNorm in bf16 too);
- `FP8 compiled` (`--fp8`; a CPU, or a GPU with FP8 tensor cores): the fast path with FP8
  GEMMs.

Per path, averaged over the batches: the loss's relative error, the whole gradient's relative
L2 error and cosine similarity, the same error by what computes the gradient (LayerNorm, each
of a layer's GEMMs, embeddings, heads), and the tensor with the largest relative error. Dropout
is off (a compiled layer draws other masks). The check: compiling costs no accuracy, i.e. the
compiled path's gradient error is at most `--compile-slack` times the eager path's (and so for
the loss, or within 1e-3 of fp64's loss); the other paths are recorded. Writes
gradient_fidelity-DEVICE-DATE.{json,md} to --output-dir and exits 1 when the check fails.

    python3 benchmarks/gradient_fidelity.py --data .gpu-data/shards-128 --train-steps 30 \
        --fp8 --output-dir $OUT
    python3 benchmarks/gradient_fidelity.py --data .gpu-data/shards-128 --num-layers 2 \\
        --micro-batch 8 --batches 2 --output-dir /tmp/fidelity      # BERT-large's width, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import math
import sys

import torch
from gpu_proof_run import device_name, run_checks, save_report, source_commit

from bertforge.training.compile_cache import use_cache_per_cpu_level
from bertforge.training.data import PretrainingLoader
from bertforge.training.engine import compile_encoder_layers, inductor_options
from bertforge.training.fp8 import fp8_unsupported_reason
from bertforge.training.model import (
    BertConfig,
    BertForPreTraining,
    set_fp8,
    set_residual_in_autocast_dtype,
)

REFERENCE = "fp64"
EAGER = "bf16 eager"
COMPILED = "bf16 compiled"


@dataclasses.dataclass(frozen=True)
class Path:
    """How one path computes: the weights' dtype, autocast's, the residual stream's, compiled
    layers, FP8 GEMMs."""

    weights: torch.dtype
    autocast: torch.dtype | None = None
    bf16_residual: bool = False
    compiled: bool = False
    fp8: bool = False


PATHS = {
    REFERENCE: Path(torch.float64),
    "fp32": Path(torch.float32),
    EAGER: Path(torch.float32, torch.bfloat16, bf16_residual=True),
    COMPILED: Path(torch.float32, torch.bfloat16, bf16_residual=True, compiled=True),
    "bf16 compiled, fp32 residual": Path(torch.float32, torch.bfloat16, compiled=True),
    "bf16 weights": Path(torch.bfloat16),
}
# A loss error this small passes whatever the eager path's (one bf16 rounding is 3.9e-3).
LOSS_FLOOR = 1e-3
FP8 = "FP8 compiled"
FP8_PATH = Path(torch.float32, torch.bfloat16, bf16_residual=True, compiled=True, fp8=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepared shard directory (real text)")
    parser.add_argument("--output-dir", required=True, help="where the results go")
    parser.add_argument("--preset", default="large", help="model size (large, base, tiny)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="encoder layers (default: the preset's); fewer keep its width")
    parser.add_argument("--micro-batch", type=int, default=64, help="sequences a batch")
    parser.add_argument("--batches", type=int, default=4, help="batches to average over")
    parser.add_argument("--init-from", default=None,
                        help="a bertforge checkpoint or run directory whose weights to use "
                             "(default: the model's initialisation, seed --seed)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="steps to train the weights first (bf16 eager, AdamW, other "
                             "batches), so that they are measured past their initialisation")
    parser.add_argument("--lr", type=float, default=1e-4, help="those steps' peak rate")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--fp8", action="store_true",
                        help="also the fast path with FP8 GEMMs (a CPU, or a GPU with FP8 "
                             "tensor cores)")
    parser.add_argument("--compile-slack", type=float, default=1.5,
                        help="how many times the eager path's error the compiled path's may be")
    parser.add_argument("--commit", default=None,
                        help="the source commit to record when the tree has no .git")
    return parser.parse_args(argv)


def load_batches(args: argparse.Namespace, device: torch.device):
    """The micro-batches to measure on (`--batches`) and, after them, those to train on
    (`--train-steps`), from the shards' train split as the loop masks them, on the device; and
    the split's vocabulary size and labels bound per row."""
    loader = PretrainingLoader(args.data, "train", batch_size=args.micro_batch, seed=args.seed,
                               rank=0, world_size=1, prefetch=0)
    wanted = args.batches + args.train_steps
    batches = []
    while len(batches) < wanted:  # across epochs if the split is small
        before = len(batches)
        for batch in itertools.islice(loader, wanted - len(batches)):
            batches.append({key: value.to(device) for key, value in batch.items()})
        if len(batches) == before:
            raise ValueError(f"{args.data}: no batch of {args.micro_batch} in its train split")
        loader.set_epoch(loader.epoch + 1)
    return (batches[:args.batches], batches[args.batches:], loader.vocab_size,
            loader.max_predictions_per_row)


def initial_weights(args: argparse.Namespace, vocab_size: int) -> tuple[BertConfig, dict]:
    """The model's shape (dropout off) and the fp32 weights every path starts from."""
    if args.init_from:
        from bertforge.training.checkpoint import load_model, resolve_checkpoint

        model, _ = load_model(resolve_checkpoint(args.init_from))  # a run: its newest
        config = model.config
    else:
        config = BertConfig.preset(args.preset, vocab_size=vocab_size)
        if args.num_layers is not None:
            config = dataclasses.replace(config, num_hidden_layers=args.num_layers)
        torch.manual_seed(args.seed)
        model = BertForPreTraining(config)  # dropout draws nothing at initialisation
    config = dataclasses.replace(config, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return config, {name: t.detach().float().clone() for name, t in model.state_dict().items()}


def train_briefly(model: BertForPreTraining, batches: list[dict], lr: float,
                  device: torch.device) -> dict:
    """The weights after a step on each batch as the fast path takes it (fp32 weights under
    bf16 autocast, AdamW with weight decay 0.01, clipping at 1.0, the learning rate warmed up
    over the first tenth): past the initialisation, where gpu_parity's curves part."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, len(batches) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                 lambda step: min(1.0, (step + 1) / warmup))
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    print(f"[gradient_fidelity] trained {len(batches)} steps: last loss {float(loss.detach()):.4f}",
          flush=True)
    return {name: t.detach().float().clone() for name, t in model.state_dict().items()}


def build(path: Path, config: BertConfig, weights: dict, max_predictions: int,
          device: torch.device) -> BertForPreTraining:
    """The model as `path` computes, its layers compiled as `engine.compile_model` does."""
    model = BertForPreTraining(config)
    model.load_state_dict(weights)
    model.max_predictions = max_predictions
    model.to(device=device, dtype=path.weights)
    set_residual_in_autocast_dtype(model, path.bf16_residual)
    set_fp8(model, path.fp8)
    if path.compiled:
        use_cache_per_cpu_level()
        compile_encoder_layers(model, inductor_options(device))
    return model


def loss_and_gradients(model: BertForPreTraining, path: Path, batch: dict,
                       device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    autocast = (torch.autocast(device.type, dtype=path.autocast) if path.autocast
                else contextlib.nullcontext())
    with autocast:
        loss = model(**batch).loss
    loss.backward()
    # One tensor a name: the decoder's bias is the head's bias (one Parameter, two names).
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters()
             if p.grad is not None}
    return float(loss.detach().double()), grads


# The parameters by what computes their gradients, every layer's together: where a path's
# error comes from (FP8's GEMMs, say, against LayerNorm's arithmetic). First match wins.
KINDS = (
    ("LayerNorm", "LayerNorm."),
    ("attention QKV", "attention.self.qkv."),
    ("attention output", "attention.output.dense."),
    ("FFN in (GELU)", "intermediate.dense."),
    ("FFN out", ".output.dense."),
    ("embeddings", "embeddings."),
    ("heads and pooler", ""),
)


def kind_of(name: str) -> str:
    return next(kind for kind, part in KINDS if part in name)


def _relative(grads: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    error = torch.cat([(g - r).flatten() for g, r in zip(grads, refs, strict=True)]).norm()
    return float(error / torch.cat([r.flatten() for r in refs]).norm().clamp(min=1e-30))


def compare(loss: float, grads: dict[str, torch.Tensor], ref_loss: float,
            ref_grads: dict[str, torch.Tensor]) -> dict:
    """Relative errors against the reference, one batch."""
    errors = {name: _relative([grads[name]], [ref]) for name, ref in ref_grads.items()}
    flat = torch.cat([grads[name].flatten() for name in ref_grads])
    ref_flat = torch.cat([ref.flatten() for ref in ref_grads.values()])
    worst = max(errors, key=errors.get)
    names_of = {kind: [n for n in ref_grads if kind_of(n) == kind] for kind, _ in KINDS}
    return {
        "loss_rel_error": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_error": _relative([flat], [ref_flat]),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0)),
        "by_kind": {kind: _relative([grads[n] for n in names], [ref_grads[n] for n in names])
                    for kind, names in names_of.items() if names},
        "worst_tensor": worst, "worst_tensor_rel_error": errors[worst],
    }


def mean_over_batches(per_batch: list[dict]) -> dict:
    worst = max(per_batch, key=lambda b: b["worst_tensor_rel_error"])
    return {
        **{key: sum(b[key] for b in per_batch) / len(per_batch)
           for key in ("loss_rel_error", "grad_rel_error", "grad_cosine")},
        "by_kind": {kind: sum(b["by_kind"][kind] for b in per_batch) / len(per_batch)
                    for kind in per_batch[0]["by_kind"]},
        "worst_tensor": worst["worst_tensor"],
        "worst_tensor_rel_error": worst["worst_tensor_rel_error"],
    }


def checks_of(measured: dict[str, dict], slack: float) -> dict[str, bool]:
    """Compiling costs no accuracy: the compiled path's errors against fp64 are at most `slack`
    times the eager path's (the loss's, or within LOSS_FLOOR: both are ~1e-5 at init)."""
    eager, compiled = measured[EAGER], measured[COMPILED]
    return {
        f"{COMPILED}: gradient error at most {slack:g}x {EAGER}'s":
            compiled["grad_rel_error"] <= slack * eager["grad_rel_error"],
        f"{COMPILED}: loss error at most {slack:g}x {EAGER}'s, or within {LOSS_FLOOR:g}":
            (compiled["loss_rel_error"] <= slack * eager["loss_rel_error"]
             or compiled["loss_rel_error"] <= LOSS_FLOOR),
        "every error finite": all(math.isfinite(m["grad_rel_error"])
                                  and math.isfinite(m["loss_rel_error"])
                                  for m in measured.values()),
    }


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default)
    batches, training, vocab_size, max_predictions = load_batches(args, device)
    config, weights = initial_weights(args, vocab_size)
    if training:
        model = build(PATHS[EAGER], config, weights, max_predictions, device)
        weights = train_briefly(model, training, args.lr, device)
        del model
    paths = dict(PATHS)
    skipped = {}
    if args.fp8:
        why = fp8_unsupported_reason(device)
        if why:
            skipped[FP8] = why
        else:
            paths[FP8] = FP8_PATH

    def through(path: Path) -> list[tuple[float, dict]]:
        model = build(path, config, weights, max_predictions, device)
        results = [loss_and_gradients(model, path, batch, device) for batch in batches]
        del model
        return results

    reference = through(paths.pop(REFERENCE))
    measured, failed = {}, {}
    for name, path in paths.items():
        try:
            results = through(path)
        except Exception as error:  # noqa: BLE001 (an experiment's failure is a result)
            if name not in (EAGER, COMPILED):
                failed[name] = f"{type(error).__name__}: {error}"
                print(f"[gradient_fidelity] {name} failed: {failed[name]}", flush=True)
                continue
            raise
        measured[name] = mean_over_batches([
            compare(loss, grads, ref_loss, ref_grads)
            for (loss, grads), (ref_loss, ref_grads) in zip(results, reference, strict=True)])
        print(f"[gradient_fidelity] {name}: {measured[name]}", flush=True)
    checks = checks_of(measured, args.compile_slack)
    return {
        "device": device_name(), "date": datetime.date.today().isoformat(),
        "commit": source_commit(args.commit), "torch": torch.__version__,
        "model": {"preset": None if args.init_from else args.preset,
                  "num_hidden_layers": config.num_hidden_layers,
                  "hidden_size": config.hidden_size, "init_from": args.init_from},
        "micro_batch": args.micro_batch, "batches": args.batches,
        "train_steps": args.train_steps, "lr": args.lr,
        "seq_len": int(batches[0]["input_ids"].shape[1]), "data": args.data,
        "reference_loss": sum(loss for loss, _ in reference) / len(reference),
        "paths": {name: {key: str(value) if isinstance(value, torch.dtype) else value
                         for key, value in dataclasses.asdict(path).items()}
                  for name, path in {REFERENCE: PATHS[REFERENCE], **paths}.items()},
        "measured": measured, "failed": failed, "skipped": skipped,
        "compile_slack": args.compile_slack, "checks": checks, "passed": all(checks.values()),
    }


def write_results(result: dict, output_dir: str) -> None:
    model = result["model"]
    source = model["init_from"] or f"{model['preset']}'s initialisation"
    if result["train_steps"]:
        source += (f", then {result['train_steps']} steps of bf16 eager AdamW at peak lr "
                   f"{result['lr']:g}")
    kinds = list(next(iter(result["measured"].values()))["by_kind"])
    lines = [
        f"# Loss and gradients against fp64 at fixed weights: {result['device']}, "
        f"{result['date']}, commit {result['commit']}",
        "",
        f"{model['num_hidden_layers']} layers of width {model['hidden_size']} ({source}), "
        f"{result['batches']} batches of {result['micro_batch']} x {result['seq_len']} from "
        f"{result['data']}, dropout off; fp64's mean loss {result['reference_loss']:.4f}; "
        f"torch {result['torch']}",
        "",
        "| path | loss: relative error | gradient: relative L2 error | cosine | worst tensor "
        "(relative error) |",
        "|---|---:|---:|---:|---|",
        *(f"| {name} | {m['loss_rel_error']:.2e} | {m['grad_rel_error']:.2e} | "
          f"{m['grad_cosine']:.6f} | {m['worst_tensor']} ({m['worst_tensor_rel_error']:.2e}) |"
          for name, m in result["measured"].items()),
        *(f"| {name} | failed: {why} | | | |" for name, why in result["failed"].items()),
        *(f"| {name} | not run: {why} | | | |" for name, why in result["skipped"].items()),
        "",
        "Gradient's relative L2 error by what computes it (every layer's tensors together):",
        "",
        "| path | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
        *(f"| {name} | " + " | ".join(f"{m['by_kind'][kind]:.2e}" for kind in kinds) + " |"
          for name, m in result["measured"].items()),
        "",
        *(f"- {name}: {'yes' if ok else 'NO'}" for name, ok in result["checks"].items()),
    ]
    save_report(output_dir, "gradient_fidelity", result, lines)


def main(argv: list[str] | None = None) -> int:
    return run_checks(parse_args, run, write_results, argv)


if __name__ == "__main__":
    sys.exit(main())
