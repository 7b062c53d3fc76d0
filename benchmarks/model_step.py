"""Forward+backward step time: training.model.BertForPreTraining vs transformers' (fp32).

Both models hold the same weights and see the same batch (~15 % of real positions labelled,
NSP labels), in training mode, with the same torch thread count, taking turns step by step.
Ours runs the MLM head, and its last encoder layer, at the labelled positions (and [CLS])
only; Hugging Face's computes every position and projects each onto the vocab.

Two batches (`--padding both`, the default; or one of them):
- `none`: every row full (attention_mask all ones), as packed pretraining instances mostly are.
  Both models then attend without a mask (Hugging Face's sdpa path drops an all-ones mask;
  ours checks on a CPU).
- `varied`: rows cut to lengths spread over [seq/2, seq], the rest [PAD] with
  attention_mask 0, labels only at real positions; both models add a padding mask.
In training (dropout on) both run SDPA's math path on a CPU either way: its flash kernel takes
no dropout. Ours replaces that path by a leaner one (scale and mask fused into one `baddbmm`).

Bound at fp32 on CPU (GEMMs are ~85 % of the step, near the cores' peak): the encoder alone is
536 of Hugging Face's 684 GFLOP at base/128/batch 8 (0.78); ours computes 526 GFLOP (0.77: sparse
head and last layer). Beyond the FLOPs, ours draws its dropout masks ~5x cheaper on a CPU and
runs its fp32 linear layers' forward and input-gradient GEMMs through oneDNN (5-15 % faster than
the MKL sgemm `F.linear` calls on this AMD Zen 4; ~45 % on the MLM decoder): 0.66 measured on
2 threads on a quiet machine (0.72-0.77 before those two). On a busy machine (other jobs on the
same cores) single steps stretch several-fold; the min-based ratio is the least disturbed.
No torch.compile on either side: eager against eager.

    python benchmarks/model_step.py --config base --seq-len 128 --batch-size 8 --iters 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from bertforge.training.hf_interop import from_hf_state_dict
from bertforge.training.model import IGNORE_INDEX, PRESETS, BertConfig, BertForPreTraining


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(PRESETS), default="base")
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--mask-prob", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--padding", choices=("none", "varied", "both"), default="both",
        help="full rows, rows of varied length padded to --seq-len, or one table of each",
    )
    return parser.parse_args(argv)


def make_batch(
    config: BertConfig, args: argparse.Namespace, padded: bool = False
) -> dict[str, torch.Tensor]:
    """Random pairs; `padded`: row lengths spread evenly over [seq/2, seq], [PAD] after."""
    generator = torch.Generator().manual_seed(args.seed)
    batch_size, seq_len = args.batch_size, args.seq_len
    input_ids = torch.randint(5, config.vocab_size, (batch_size, seq_len), generator=generator)
    lengths = torch.full((batch_size,), seq_len)
    if padded:
        lengths = seq_len - torch.arange(batch_size) * (seq_len // 2) // max(1, batch_size - 1)
    real = torch.arange(seq_len) < lengths[:, None]
    input_ids[~real] = config.pad_token_id
    # Segment B starts half-way through each row's real tokens.
    token_type_ids = ((torch.arange(seq_len) >= lengths[:, None] // 2) & real).long()
    # round(length x p) labels per row at real positions: 128 x 0.15 = 19 (Google's max 20).
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX)
    for row, length in enumerate(lengths.tolist()):
        num_predicted = max(1, round(length * args.mask_prob))
        positions = torch.randperm(length, generator=generator)[:num_predicted]
        labels[row, positions] = input_ids[row, positions]
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": real.long(),
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=generator),
    }


def time_interleaved(
    steps: dict[str, Callable[[], float]], warmup: int, iters: int
) -> dict[str, tuple[list[float], float]]:
    """Seconds per call of each step and the last loss, the models taking turns step by step.

    Taking turns (ours, theirs, ours, ...) exposes both to the same background load on a
    shared machine; timing one model's steps and then the other's would not.
    """
    losses = {name: float("nan") for name in steps}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            start = time.perf_counter()
            losses[name] = step()
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return {name: (seconds[name], losses[name]) for name in steps}


def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], float]:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.item()

    return step


def build_models(config: BertConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Hugging Face's model (its default attention: sdpa) and ours with the very same weights."""
    hf_config = transformers.BertConfig(**config.to_dict())
    hf_model = transformers.BertForPreTraining(hf_config).train()
    ours = BertForPreTraining(config).train()
    ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), config))
    return ours, hf_model


def report(
    results: dict[str, tuple[list[float], float]], tokens: int, title: str
) -> None:
    print(title)
    print(f"{'model':<14}{'median ms':>12}{'min ms':>10}{'tok/s':>10}{'last loss':>11}")
    medians = {}
    for name, (seconds, loss) in results.items():
        medians[name] = statistics.median(seconds)
        print(
            f"{name:<14}{medians[name] * 1e3:>12.1f}{min(seconds) * 1e3:>10.1f}"
            f"{tokens / medians[name]:>10.0f}{loss:>11.4f}"
        )
    ratio = medians["bertforge"] / medians["transformers"]
    paired = statistics.median(
        a / b for a, b in zip(results["bertforge"][0], results["transformers"][0], strict=True)
    )
    print(f"ratio bertforge/transformers (median): {ratio:.3f}")
    fastest = min(results["bertforge"][0]) / min(results["transformers"][0])
    print(f"ratio bertforge/transformers (min): {fastest:.3f}")
    print(f"ratio bertforge/transformers (median of paired steps): {paired:.3f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = BertConfig.preset(args.config, vocab_size=args.vocab_size)
    ours, hf_model = build_models(config)
    print(
        f"config={args.config} vocab={config.vocab_size} seq={args.seq_len} "
        f"batch={args.batch_size} threads={torch.get_num_threads()} iters={args.iters} "
        f"warmup={args.warmup} fp32 cpu eager torch={torch.__version__} "
        f"transformers={transformers.__version__}"
    )
    cases = ("none", "varied") if args.padding == "both" else (args.padding,)
    for case in cases:
        batch = make_batch(config, args, padded=case == "varied")
        torch.manual_seed(args.seed)
        results = time_interleaved(
            {"bertforge": train_step(ours, batch), "transformers": train_step(hf_model, batch)},
            args.warmup, args.iters,
        )
        real_tokens = int(batch["attention_mask"].sum())
        report(results, real_tokens, f"\npadding={case} ({real_tokens} real tokens)")


if __name__ == "__main__":
    main()
