"""Fine-tuning: `bertforge finetune` against a plain single-process `transformers` loop (issue 24).

Both sides train the same model directory (random weights, written the way `bertforge export`
writes a Hugging Face directory) on the same batches in the same order: the plain loop takes
bertforge's own encoded features (`load_task_data`), its batch order (`batch_indices`, seed,
epoch) and its dynamic padding (each batch cut to its longest row), and runs
`transformers.BertForSequenceClassification` (SDPA attention) with `torch.optim.AdamW` (no decay
on biases and LayerNorm, eps 1e-6), gradient clipping at 1.0 and 10 % linear warm-up then
linear decay, fp32, in one process at `torch.set_num_threads(T)`. `bertforge finetune` runs as a
subprocess (Ray, DeepSpeed), and its steps are timed from its `result.json` (`train_seconds`
over `steps`: the training steps only, no start-up); the plain loop's are timed the same way
(first step to last, evaluation apart), in a fresh Python process of its own, as bertforge's
worker is. Each side's step durations give a steady figure too (the median step after the
first, whose warm-up a short run weighs heavily). Runs alternate (plain, bertforge, ...) within
one invocation, so load from other jobs on the machine falls on both.

Two models:
- `demo`: the demo's shape (2 layers, 128 wide, 2 heads, 8,192-piece vocabulary), 2,000 lines,
  2 epochs of batch 16 at 48 tokens, lr 3e-4, dev accuracy on both sides;
- `base`: BERT-base's shape (12 layers, 768 wide, 30,522 pieces) at 128 tokens (every row
  full: long lines), a few steps only (`--base-steps`).

Data: SST-2 from `--glue-dir` (default ../shared/data/glue) when it is there (lines of 10+
words, a fixed subset, as the demo's budget), else a reproducible synthetic sentiment-like TSV.

    .venv/bin/python benchmarks/finetune_vs_plain_loop.py --repeats 2 \
        --out benchmarks/results/finetune_vs_plain_loop.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bertforge.training.finetune.config import FinetuneConfig
from bertforge.training.finetune.loop import batch_indices, count_steps, trim_padding
from bertforge.training.finetune.task_data import load_task_data
from bertforge.training.hf_interop import export_hf_directory
from bertforge.training.model import BertConfig, BertForPreTraining

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
POSITIVE = ("good great fine lovely moving superb charming funny warm bright clever tender "
            "wonderful delightful gripping smart fresh touching").split()
NEGATIVE = ("bad dull poor boring flat tired awful clumsy stale weak messy silly bland "
            "tedious hollow lifeless painful shallow").split()
NEUTRAL = ("the a film movie story plot cast director actor scene script with and of it is "
           "this that but its an as for by on in to was very too rather quite at times "
           "performance ending dialogue camera music characters").split()


# --- data and models ---------------------------------------------------------------------


def synthetic_lines(count: int, seed: int, words: tuple[int, int]) -> list[tuple[str, int]]:
    """Sentiment-like lines: neutral filler with a few polar words; the label is the majority
    polarity (ties broken by the first polar word), so it is learnable but not by one word."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        label = rng.randint(0, 1)
        n = rng.randint(*words)
        polar = [rng.choice(POSITIVE if label else NEGATIVE) for _ in range(3)]
        polar.append(rng.choice(NEGATIVE if label else POSITIVE))  # one word against
        tokens = [rng.choice(NEUTRAL) for _ in range(max(0, n - len(polar)))] + polar
        rng.shuffle(tokens)
        lines.append((" ".join(tokens), label))
    return lines


def sst2_lines(glue_dir: str, split: str, count: int | None, seed: int,
               min_words: int) -> list[tuple[str, int]]:
    path = os.path.join(glue_dir, "SST-2", f"{split}.tsv")
    with open(path, encoding="utf-8") as f:
        next(f)
        rows = [line.rstrip("\n").split("\t") for line in f]
    lines = [(text, int(label)) for text, label in rows if len(text.split()) >= min_words]
    if count is not None and count < len(lines):
        lines = random.Random(seed).sample(lines, count)
    return lines


def write_tsv(path: str, lines: list[tuple[str, int]]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tlabel\n")
        for text, label in lines:
            f.write(f"{text}\t{label}\n")
    return path


def write_vocab(path: str, texts: list[str], size: int) -> str:
    """Specials, characters, the data's words, then filler pieces up to `size`."""
    words: dict[str, None] = {}
    for text in texts:
        for word in text.lower().split():
            words.setdefault(word.strip(".,!?;:'\"()-"), None)
    chars = sorted({c for text in texts for c in text.lower() if not c.isspace()})
    tokens = list(dict.fromkeys(SPECIALS + chars + [w for w in words if w]))[:size]
    tokens += [f"##filler{i}" for i in range(size - len(tokens))]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")
    return path


def write_model(directory: str, config: BertConfig, vocab: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = BertForPreTraining(config)
    return export_hf_directory(model.state_dict(), config, vocab, True, directory,
                               overwrite=True)


# --- the plain loop ----------------------------------------------------------------------


def plain_loop(model_dir: str, cfg: FinetuneConfig, threads: int, evaluate: bool) -> dict:
    """transformers + torch AdamW on bertforge's batches; seconds per step, dev accuracy."""
    import transformers

    torch.set_num_threads(threads)
    seed = cfg.seeds[0]
    data = load_task_data(cfg, os.path.join(model_dir, "vocab.txt"), True)
    steps_per_epoch, num_steps = count_steps(cfg, data.num_train_rows)
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(
        model_dir, num_labels=2, attn_implementation="sdpa")
    decay = [p for n, p in model.named_parameters()
             if not (n.endswith("bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters()
                if n.endswith("bias") or "LayerNorm" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=cfg.learning_rate, eps=cfg.adam_eps)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, int(cfg.warmup_fraction * num_steps), num_steps)
    names = ("input_ids", "token_type_ids", "attention_mask", "labels")
    model.train()
    started = last = time.perf_counter()
    step_seconds = []
    for step in range(num_steps):
        rows = torch.from_numpy(batch_indices(data.num_train_rows, cfg.batch_size, step,
                                              steps_per_epoch, seed, 0, 1))
        batch = trim_padding({k: data.train[k][rows] for k in names})
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the step's end (on a GPU it would wait for it)
        step_seconds.append(time.perf_counter() - last)
        last = time.perf_counter()
    seconds = time.perf_counter() - started
    record = {"steps": num_steps, "train_seconds": seconds, "final_train_loss": loss_value,
              "step_durations": step_seconds}
    if evaluate:
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, data.dev["input_ids"].shape[0], cfg.eval_batch_size):
                batch = trim_padding({k: data.dev[k][start:start + cfg.eval_batch_size]
                                      for k in names[:3]})
                predicted = model(**batch).logits.argmax(-1)
                correct += int((predicted == data.dev["labels"][
                    start:start + cfg.eval_batch_size]).sum())
        record["accuracy"] = correct / data.dev["input_ids"].shape[0]
    return record


def plain_loop_in_a_fresh_process(cfg: FinetuneConfig, threads: int, evaluate: bool) -> dict:
    """`plain_loop` in a new Python process, as a user's script runs, and as `bertforge
    finetune`'s worker starts: neither side inherits a warm heap or warm kernels."""
    request = json.dumps({"cfg": cfg.to_dict(), "threads": threads, "evaluate": evaluate})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--plain-run", request],
                          capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError("the plain loop failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- bertforge finetune ------------------------------------------------------------------


def bertforge_finetune(cfg: FinetuneConfig, output: str, launch: list[str]) -> dict:
    """`bertforge finetune` as a user runs it; its run's result.json (train_seconds, steps)."""
    exe = os.path.join(os.path.dirname(sys.executable), "bertforge")
    command = [
        exe, "finetune", "--task", "sst2", "--model", cfg.model, "--output", output,
        "--train", cfg.train, "--dev", cfg.dev, "--lr", str(cfg.learning_rate),
        "--epochs", str(cfg.epochs), "--batch-size", str(cfg.batch_size),
        "--max-seq-length", str(cfg.seq_length), "--precision", "fp32",
        "--seeds", str(cfg.seeds[0]), "--log-every", "1",
        *(["--max-steps", str(cfg.max_steps)]
                                         if cfg.max_steps else []), *launch,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"bertforge finetune failed: {' '.join(command)}")
    with open(os.path.join(output, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    run = results["sweep"]["runs"][0]
    with open(os.path.join(run["run_dir"], "result.json"), encoding="utf-8") as f:
        record = json.load(f)
    record["wall_seconds"] = wall
    record["accuracy"] = record["metrics"].get("accuracy")
    # Each step's duration from its metrics line (--log-every 1); the first one's is what the
    # training time holds beyond the others.
    with open(os.path.join(run["run_dir"], "metrics.jsonl"), encoding="utf-8") as f:
        times = [json.loads(line)["time"] for line in f]
    later = [b - a for a, b in zip(times, times[1:], strict=False)]
    record["step_durations"] = [record["train_seconds"] - sum(later)] + later
    return record


# --- the comparison ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--glue-dir", default=os.path.join(REPO, "..", "shared",
                                                           "data", "glue"))
    parser.add_argument("--synthetic", action="store_true", help="ignore SST-2 even if present")
    parser.add_argument("--models", nargs="+", choices=("demo", "base"),
                        default=["demo", "base"])
    parser.add_argument("--demo-lines", type=int, default=2000)
    parser.add_argument("--demo-dev-lines", type=int, default=872)
    parser.add_argument("--base-steps", type=int, default=8)
    parser.add_argument("--base-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="plain-loop thread counts")
    parser.add_argument("--launches", nargs="+", default=["1x1", "default"],
                        help="bertforge launches: WORKERSxCPUS_PER_WORKER, or 'default' (no "
                        "launch flags)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over every configuration; the fastest is kept")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    return parser.parse_args(argv)


def launch_flags(launch: str) -> list[str]:
    if launch == "default":
        return []
    workers, cpus = launch.split("x")
    return ["--workers", workers, "--cpus-per-worker", cpus]


def prepare(args: argparse.Namespace, work: str, name: str) -> tuple[FinetuneConfig, str]:
    """The model directory and the config both sides train with."""
    use_sst2 = not args.synthetic and os.path.isdir(os.path.join(args.glue_dir, "SST-2"))
    if name == "demo":
        if use_sst2:
            train = sst2_lines(args.glue_dir, "train", args.demo_lines, args.seed, 10)
            dev = sst2_lines(args.glue_dir, "dev", args.demo_dev_lines, args.seed, 0)
        else:
            train = synthetic_lines(args.demo_lines, args.seed, (6, 30))
            dev = synthetic_lines(args.demo_dev_lines, args.seed + 1, (6, 30))
        config = BertConfig(vocab_size=8192, hidden_size=128, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=512)
        settings = dict(epochs=2.0, batch_size=16, max_seq_length=48, learning_rate=3e-4)
    else:  # every row past 128 tokens: BERT-base at its full 128
        steps, batch = args.base_steps, args.base_batch_size
        train = synthetic_lines(steps * batch + batch, args.seed, (140, 180))
        dev = synthetic_lines(batch, args.seed + 1, (140, 180))
        config = BertConfig()
        settings = dict(epochs=1.0, batch_size=batch, max_seq_length=128,
                        learning_rate=5e-5, max_steps=steps)
    folder = os.path.join(work, name)
    os.makedirs(folder, exist_ok=True)
    train_path = write_tsv(os.path.join(folder, "train.tsv"), train)
    dev_path = write_tsv(os.path.join(folder, "dev.tsv"), dev)
    vocab = write_vocab(os.path.join(folder, "vocab.txt"), [t for t, _ in train + dev],
                        config.vocab_size)
    model_dir = write_model(os.path.join(folder, "model"), config, vocab, args.seed)
    cfg = FinetuneConfig(task="sst2", model=model_dir, output=os.path.join(folder, "out"),
                         train=train_path, dev=dev_path, seeds=(args.seed,), precision="fp32",
                         **settings)
    source = "SST-2" if name == "demo" and use_sst2 else "synthetic"
    return cfg, f"{source}, {len(train)} train / {len(dev)} dev lines"


def compare(args: argparse.Namespace, work: str, name: str) -> list[dict]:
    """Every plain-loop thread count and bertforge launch, interleaved (plain 1 thread,
    bertforge's first launch, plain 2 threads, its second, ...), `--repeats` times over; each
    configuration keeps its fastest repeat (the least disturbed by other jobs)."""
    cfg, data_note = prepare(args, work, name)
    print(f"[{name}] data: {data_note}", flush=True)
    evaluate = name == "demo"
    plain = [("plain", t) for t in args.threads]
    ours = [("bertforge", x) for x in args.launches]
    order = [run for pair in itertools.zip_longest(plain, ours) for run in pair if run]
    best: dict[tuple[str, object], dict] = {}
    for repeat in range(args.repeats):
        for kind, what in order:
            if kind == "plain":
                record = plain_loop_in_a_fresh_process(cfg, what, evaluate)
                record["threads"] = what
                label = f"plain loop, {what} thread{'s' if what > 1 else ''}"
            else:
                output = os.path.join(work, name, f"bertforge-{what}-{repeat}")
                record = bertforge_finetune(cfg, output, launch_flags(what))
                label = (f"bertforge finetune, {what} ({record['world_size']} worker(s) x "
                         f"{record.get('threads', '?')} thread(s))")
            record.update(model=name, kind=kind, what=what, label=label,
                          step_seconds=record["train_seconds"] / record["steps"],
                          steady_seconds=statistics.median(record["step_durations"][1:]
                                                           or record["step_durations"]))
            accuracy = f", dev accuracy {record['accuracy']:.3f}" if evaluate else ""
            print(f"[{name}] {label}: {record['step_seconds']:.4f} s/step over "
                  f"{record['steps']} steps (steady {record['steady_seconds']:.4f}){accuracy}",
                  flush=True)
            seen = best.get((kind, what))
            record["all_step_seconds"] = (seen["all_step_seconds"] if seen else []) + [
                record["step_seconds"]]
            if seen is None or record["step_seconds"] < seen["step_seconds"]:
                if seen is not None:
                    record["steady_seconds"] = min(record["steady_seconds"],
                                                   seen["steady_seconds"])
                best[(kind, what)] = record
            else:
                seen["all_step_seconds"] = record["all_step_seconds"]
                seen["steady_seconds"] = min(record["steady_seconds"], seen["steady_seconds"])
    return [best[run] for run in order]


def table(rows: list[dict]) -> list[str]:
    """Per configuration: seconds per step over all steps (the first one's warm-up included)
    and steady (the median step after the first), each as a ratio to the plain loop at the same
    threads and to the plain loop's best."""
    lines = ["| model | run | steps | s/step, all (best) | every repeat | ratio, same threads | "
             "ratio to plain's best | s/step, steady | steady ratio, same threads | "
             "steady ratio to plain's best | dev acc |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        plain = {r["what"]: r for r in mine if r["kind"] == "plain"}
        best = min(r["step_seconds"] for r in plain.values())
        best_steady = min(r["steady_seconds"] for r in plain.values())
        for r in mine:
            same = same_steady = ""
            threads = r.get("world_size", 1) * r.get("threads", 0)
            if r["kind"] == "bertforge" and threads in plain:
                same = f"{r['step_seconds'] / plain[threads]['step_seconds']:.2f}"
                same_steady = f"{r['steady_seconds'] / plain[threads]['steady_seconds']:.2f}"
            accuracy = f"{r['accuracy']:.3f}" if r.get("accuracy") is not None else "-"
            every = " ".join(f"{x:.4f}" for x in r["all_step_seconds"])
            lines.append(f"| {model} | {r['label']} | {r['steps']} | {r['step_seconds']:.4f} | "
                         f"{every} | {same} | {r['step_seconds'] / best:.2f} | "
                         f"{r['steady_seconds']:.4f} | {same_steady} | "
                         f"{r['steady_seconds'] / best_steady:.2f} | {accuracy} |")
    return lines


def cpu_facts() -> tuple[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown", "unknown"
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                  if line.startswith("Model name")), "unknown")
    import re

    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", out)))
    return model, " ".join(flags) or "none (no AVX-512, no AMX)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plain-run"]:  # plain_loop_in_a_fresh_process's child
        request = json.loads(argv[1])
        cfg = FinetuneConfig.from_dict(request["cfg"])
        print(json.dumps(plain_loop(cfg.model, cfg, request["threads"], request["evaluate"])))
        return
    args = parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="ft-vs-plain-")
    load_at_start = os.getloadavg()[0]
    rows = []
    for name in args.models:
        rows += compare(args, work, name)
    model, flags = cpu_facts()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    import deepspeed
    import transformers

    header = [f"finetune_vs_plain_loop.py, {datetime.date.today()}, commit {commit}",
              "command: python benchmarks/finetune_vs_plain_loop.py " + " ".join(
                  argv),
              f"CPU: {model}, {os.cpu_count()} cores; AVX-512/AMX flags: {flags}",
              f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"deepspeed {deepspeed.__version__}; fp32",
              f"load average (1 min) at the start {load_at_start:.2f}, at the end "
              f"{os.getloadavg()[0]:.2f}", ""]
    text = "\n".join(header + table(rows))
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
