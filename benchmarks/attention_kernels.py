"""Where attention's time goes: SDPA's kernels alone at BERT's shapes, by backend, with and
without the padding mask and dropout.

At 512 tokens attention is a quarter of a BERT-large step's kernel time on an H200 (the
profile of 2026-11-28: cuDNN's flash kernels at 123 TFLOP/s forward and 186 backward, a sixth
to a quarter of the card's bf16 rate). Whether that is the kernel's own speed at a head of 64,
the additive padding mask (BERT's `[B, 1, 1, S]` bias), or dropout's in-kernel random numbers
is what this measures: each backend SDPA offers (cuDNN, flash, memory-efficient, math) times
forward and forward + backward for each of the four combinations, on the layout the model
hands SDPA (query, key and value split from one QKV GEMM's output, heads transposed, so not
contiguous), at the model's width and head size. A combination a backend does not serve (flash
takes no mask) is reported as such, not timed. The `jagged-*` rows give the same kernels
nested tensors (`torch.nested`, jagged layout) of each row's own tokens instead: there "mask"
means the short rows are cut to their length, the way a model without a padding bias would
hand them over (their query, key and value contiguous: a copy the model's QKV GEMM could
write directly).

TFLOP/s count the attention's GEMMs at every padded position (4 B H S^2 D forward, 2.5 times
that backward, as flash recomputes the scores), so a row with the mask does the same work.

    python benchmarks/attention_kernels.py                         # 128 x 256 and 512 x 64
    python benchmarks/attention_kernels.py --shapes 512x64 --heads 16 --head-size 64
    CUDA_VISIBLE_DEVICES= python benchmarks/attention_kernels.py --device cpu \\
        --shapes 64x4 --heads 2 --head-size 16 --repeats 2 --output-dir /tmp/attn  # smoke

Output: a markdown table and its JSON under `--output-dir`
(attention_kernels_<device>_<date>.{md,json}, never overwriting).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_throughput as gt  # noqa: E402

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
    # The same kernels on nested tensors of the jagged layout: each row only as long as its
    # tokens, so padding is left out by the sequence offsets (flash-attention's varlen kernel)
    # rather than masked by a bias; flash then serves the masked case too, with dropout.
    "jagged-flash": SDPBackend.FLASH_ATTENTION,
    "jagged-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "jagged-math": SDPBackend.MATH,
}
# (mask, dropout): the four combinations, BERT's own (both) last.
COMBINATIONS = ((False, False), (True, False), (False, True), (True, True))
DROPOUT = 0.1  # BERT's attention_probs_dropout_prob
SHORT_ROWS = 0.1  # Google's short_seq_prob: about this share of rows is padded
NESTED_SDPA_LOGGER = "torch.nested._internal.sdpa"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", default="128x256,512x64",
                        help="comma-separated <seq len>x<batch>")
    parser.add_argument("--heads", type=int, default=16, help="BERT-large's 16")
    parser.add_argument("--head-size", type=int, default=64, help="BERT-large's 64")
    # jagged-math, the nested tensors' math path, is a CPU's way to run the jagged rows: on a
    # GPU it loops over the rows in Python.
    parser.add_argument("--backends", default=",".join(b for b in BACKENDS if b != "jagged-math"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--output-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    return args


def model_inputs(seq_len: int, batch: int, heads: int, head_size: int, device: str,
                 generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Query, key and value as training.model.BertSelfAttention hands them to SDPA (views of
    one [B, S, 3 H D] tensor, heads transposed), bf16, each requiring its gradient; and the
    padding bias, [B, 1, 1, S], 0 or bf16's lowest where a key is padding; and each row's
    length."""
    width = heads * head_size
    qkv = torch.randn(batch, seq_len, 3 * width, generator=generator).to(device, torch.bfloat16)
    qkv.requires_grad_(True)
    query, key, value = (x.view(batch, seq_len, heads, head_size).transpose(1, 2)
                         for x in qkv.split(width, dim=-1))
    lengths = torch.full((batch,), seq_len)
    short = torch.rand(batch, generator=generator) < SHORT_ROWS
    lengths[short] = torch.randint(2, seq_len, (int(short.sum()),), generator=generator)
    padding = torch.arange(seq_len)[None, :] >= lengths[:, None]
    bias = torch.zeros(batch, 1, 1, seq_len, dtype=torch.bfloat16)
    bias.masked_fill_(padding[:, None, None, :], torch.finfo(torch.bfloat16).min)
    return qkv, query, key, value, bias.to(device), lengths


def attention_flops(seq_len: int, batch: int, heads: int, head_size: int) -> float:
    """Forward FLOPs of the two attention GEMMs (scores and context) at every position."""
    return 4.0 * batch * heads * seq_len * seq_len * head_size


def time_ms(fn, device: str, warmup: int, repeats: int) -> float:
    """Mean milliseconds of `fn()` over `repeats` calls back to back, one device wait at the
    end: a sub-millisecond kernel timed alone would carry its launch and the wait with it."""
    for _ in range(warmup):
        fn()
    gt.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    gt.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def measure(backend: str, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, masked: bool,
            dropout: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One row: `backend` on `inputs` (model_inputs'), the output's gradient `grad`."""
    _, query, key, value, bias, lengths = inputs
    batch, _, seq_len, _ = query.shape
    p = DROPOUT if dropout else 0.0
    row = {"backend": backend, "seq_len": seq_len, "batch": batch, "mask": masked,
           "dropout": p}
    if backend.startswith("jagged-"):
        forward, forward_backward = _jagged_calls(backend, query, key, value,
                                                  lengths if masked else None, p)
    else:
        forward, forward_backward = _padded_calls(backend, query, key, value,
                                                  bias if masked else None, grad, p)

    # SDPA says why a backend declines in warnings, then raises "No available kernel": the
    # reasons go into the row, not onto the console once a row.
    with warnings.catch_warnings(record=True) as declined:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                row["forward_ms"] = time_ms(forward, args.device, args.warmup, args.repeats)
            row["forward_backward_ms"] = time_ms(forward_backward, args.device, args.warmup,
                                                 args.repeats)
        except RuntimeError as error:
            reasons = [str(w.message).splitlines()[0] for w in declined]
            row["not_served"] = "; ".join(reasons or [str(error).splitlines()[0]])[:300]
            return row
    flops = attention_flops(seq_len, batch, args.heads, args.head_size)
    backward_ms = row["forward_backward_ms"] - row["forward_ms"]
    row["backward_ms"] = backward_ms
    row["forward_tflops"] = flops / row["forward_ms"] / 1e9
    row["backward_tflops"] = 2.5 * flops / backward_ms / 1e9 if backward_ms > 0 else None
    return row


def _padded_calls(backend: str, query, key, value, mask, grad, p: float):
    """The model's call: SDPA over the padded views, padding masked by the bias if any."""
    def forward() -> torch.Tensor:
        with sdpa_kernel([BACKENDS[backend]]):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                  dropout_p=p)

    def forward_backward() -> None:
        # The gradients of query, key and value themselves: not summed into the QKV output's
        # (a copy of 3 B S H that is the split's backward, not attention's).
        torch.autograd.grad(forward(), (query, key, value), grad)

    return forward, forward_backward


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _jagged_calls(backend: str, query, key, value, lengths, p: float):
    """SDPA over nested tensors of each row's tokens (all of them where `lengths` is None):
    [B, H, j, D] views of contiguous [tokens, H, D] leaves, as flash's varlen kernel takes
    them."""
    batch, heads, seq_len, head_size = query.shape
    if lengths is None:
        lengths = torch.full((batch,), seq_len)
    keep = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(query.device)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(query.device)
    leaves = [x.detach().transpose(1, 2)[keep].contiguous().requires_grad_(True)
              for x in (query, key, value)]
    grad = torch.randn_like(leaves[0])
    # Known here, on the host: the nested tensors would otherwise read them back from the
    # device at every call, a wait that a model's step could not afford either.
    seqlens = {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())}

    def forward() -> torch.Tensor:
        q, k, v = (torch.nested.nested_tensor_from_jagged(x, offsets, **seqlens).transpose(1, 2)
                   for x in leaves)
        # A backend that declines logs its reasons, a line each, rather than warning: the row
        # says "not served" with SDPA's error instead.
        with sdpa_kernel([BACKENDS[backend]]), _quiet(NESTED_SDPA_LOGGER):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p).transpose(1, 2)

    def forward_backward() -> None:
        torch.autograd.grad(forward().values(), leaves, grad)

    return forward, forward_backward


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# SDPA's kernels at BERT's shapes: {env['device']}, {env['date']}", "",
             f"- commit: {env['commit']}; torch {env['torch']}, CUDA {env['cuda']}, "
             f"Python {env['python']}",
             f"- {report['heads']} heads of {report['head_size']}, bf16, the model's layout "
             f"(views of one QKV output); mask: the padding bias [B, 1, 1, S] with "
             f"{SHORT_ROWS:.0%} of rows short; dropout {DROPOUT}; mean of "
             f"{report['repeats']} calls back to back after {report['warmup']}",
             "- TFLOP/s: the attention GEMMs at every padded position (backward: 2.5x the "
             "forward's, as flash recomputes the scores)", "",
             "| seq x batch | backend | mask | dropout | forward ms | backward ms | "
             "forward TFLOP/s | backward TFLOP/s |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        head = (f"| {r['seq_len']} x {r['batch']} | {r['backend']} | "
                f"{'yes' if r['mask'] else 'no'} | {r['dropout']:g} ")
        if "not_served" in r:
            lines.append(head + "| not served | | | |")
            continue
        backward = r["backward_tflops"]
        lines.append(head + f"| {r['forward_ms']:.3f} | {r['backward_ms']:.3f} "
                     f"| {r['forward_tflops']:.1f} "
                     f"| {'n/a' if backward is None else f'{backward:.1f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    gt.check_device(args.device)
    name = gt.device_name(args.device)
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "environment": {"device": name, "date": now.strftime("%Y-%m-%d"),
                        "time_utc": now.isoformat(timespec="seconds"),
                        "torch": torch.__version__, "cuda": torch.version.cuda,
                        "python": platform.python_version(), "commit": gt.source_commit(args),
                        "command": " ".join(sys.argv)},
        "heads": args.heads, "head_size": args.head_size, "warmup": args.warmup,
        "repeats": args.repeats, "results": [],
    }
    json_path, md_path = gt.output_paths(args.output_dir, name, report["environment"]["date"],
                                         "", script="attention_kernels")
    for shape in args.shapes.split(","):
        seq_len, batch = (int(x) for x in shape.split("x"))
        # One set of inputs a shape, for every row (100 M numbers at BERT-large's shapes).
        generator = torch.Generator().manual_seed(args.seed)
        inputs = model_inputs(seq_len, batch, args.heads, args.head_size, args.device,
                              generator)
        grad = torch.randn(inputs[1].shape, generator=generator).to(args.device, torch.bfloat16)
        for backend in args.backends.split(","):
            for masked, dropout in COMBINATIONS:
                report["results"].append(measure(backend, inputs, grad, masked, dropout, args))
                # Rewritten after each row: a run cut short keeps what it measured.
                with open(json_path, "w") as f:
                    json.dump(report, f, indent=1)
                with open(md_path, "w") as f:
                    f.write(markdown(report))
    print(markdown(report))
    print(f"wrote {json_path}\nwrote {md_path}")
    return report


if __name__ == "__main__":
    main()
