"""What a local `bertforge prepare` costs to finish after a `kill -9` (issue 23, item 5: "the
rerun's wall time after a kill at ~80 % is under 40 % of a full run").

On one corpus (generated as by `prepare_at_scale.py`, --size-gb, or --input files):
1. the full run: `bertforge prepare --input FILES --output DIR --vocab VOCAB --direct_num_workers
   2 --direct_running_mode multi_processing` (+ --prepare-args) to completion; its wall time W and
   the sha256 of every shard (OUTPUT/*/*.arrow);
2. for each --kill-at fraction f (default 0.8): the same command into a fresh output, its whole
   process group (the command and Beam's worker processes) killed with SIGKILL at f x W, as the
   OOM killer would; then the bundles its work folder (OUTPUT/.prepare-work) records as done
   (where the kill really landed: on a busy machine this run may be ahead of the full run, or
   behind; one that already finished is reported, not measured);
3. the same command again into that output (the resume): its wall time R, and the checks: it
   exits 0, its log says "continued an earlier run: N bundles it had done reused, M run now"
   with N at least the bundles done at the kill (unless none were: a kill during start-up leaves
   nothing to continue), its shards are byte-identical to the full run's, and neither
   OUTPUT/.prepare-work nor any temporary file (`*.tmp`, `*.tmp-*`) is left.

Then a markdown table (machine, date and commit above it): the corpus, the kill point (fraction
and seconds), W, the killed run's wall time, R, R/W (target < 0.40 at a kill at ~0.8), bundles
reused/run, and whether the shards are identical. Exits 1 when a check fails. Every run pays
the job's fixed cost (imports, pipeline construction, worker start: ~10-15 s on 2 cores), the
resume too, so R/W means something only when W is well above it (0.15 GB: minutes).

    .venv/bin/python benchmarks/prepare_resume.py [--size-gb 0.15 | --input FILE ...]
        [--kill-at 0.8 [0.3 ...]] [--vocab vocab.txt] [--prepare-args "--num_shards 8"]
        [--work-dir /tmp/bertforge-prepare-at-scale] [--keep]
        [--out benchmarks/results/prepare_resume_MACHINE_DATE.md]

A generated corpus is reused when already under --work-dir (the same one `prepare_at_scale.py`
makes); outputs go to WORK_DIR/out-resume-*. Without --vocab: ../shared/data's BERT uncased
vocabulary, else one trained on the generated corpus. The job's identity includes the code of
`pipelines/`: an edit there between the killed run and the resume makes the resume refuse the
work ("unfinished run of another job"), so leave the checkout alone while this runs (the script
checks the code's digest before each run and says so instead of running).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import prepare_at_scale as scale  # the sibling benchmark: its corpus generator and machine lines

from bertforge.pipelines.local_job import code_digest

REPO, BERTFORGE, MB, log = scale.REPO, scale.BERTFORGE, scale.MB, scale.log
WORK_DIR_NAME = ".prepare-work"  # pipelines/local/work_dir.py
CONTINUED = re.compile(r"continued an earlier run: (\d+) bundles it had done reused, (\d+) run now")
R_OVER_W_TARGET, TARGET_KILL_AT = 0.40, (0.7, 0.9)  # the "a kill at ~80 %"


# ---------------------------------------------------------------------------------------------
# The corpus


def input_corpus(patterns: list[str]) -> dict:
    """--input (a `format:` prefix, e.g. `books:`, and globs allowed; made absolute, the command
    runs in the repository root): its files' size."""
    inputs, paths = [], []
    for pattern in patterns:
        prefix, path = re.fullmatch(r"([a-z]+:(?!//))?(.*)", pattern).groups()
        found = sorted(glob.glob(path))
        if not found:
            raise SystemExit(f"--input {pattern}: no such file")
        inputs.append((prefix or "") + os.path.abspath(path))
        paths += found
    return {"inputs": inputs, "bytes": sum(os.path.getsize(p) for p in paths),
            "files": len(paths), "documents": None, "name": "--input"}  # fmt: skip


def generated_corpus(args) -> dict:
    words, args.words_source = scale.read_words(args.vocab, args.seed)
    if args.vocab is None:
        args.vocab = scale.trained_vocab(args.work_dir, args.seed, words, args.file_mb)
    corpus = scale.ensure_corpus(args.work_dir, args.size_gb, args.seed, words, args.file_mb)
    return {"inputs": corpus["paths"], "bytes": corpus["bytes"], "files": len(corpus["paths"]),
            "documents": corpus["documents"], "name": f"generated {args.size_gb:g} GB, "
            f"sha256 {corpus['sha256'][:12]}"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The runs


def prepare_argv(corpus: dict, output: str, vocab: str, extra: list[str]) -> list[str]:
    return [BERTFORGE, "prepare", *[a for p in corpus["inputs"] for a in ("--input", p)],
            "--output", output, "--vocab", vocab, "--direct_num_workers", "2",
            "--direct_running_mode", "multi_processing", *extra]  # fmt: skip


def start(argv: list[str], log_path: str) -> subprocess.Popen:
    """The command in a process group of its own (its Beam workers join it), log to a file."""
    with open(log_path, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)  # fmt: skip


def run_to_end(argv: list[str], log_path: str) -> dict:
    began = time.perf_counter()
    proc = start(argv, log_path)
    returncode = proc.wait()
    seconds = time.perf_counter() - began
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return {"seconds": seconds, "returncode": returncode, "log": text, "log_path": log_path}


def run_and_kill(argv: list[str], log_path: str, after: float) -> dict:
    """Starts the command, SIGKILLs its whole process group `after` seconds in (if it still runs)
    and waits until no process of the group is left."""
    began = time.perf_counter()
    proc = start(argv, log_path)
    try:
        proc.wait(timeout=after)
        killed = False  # it finished first
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    seconds = time.perf_counter() - began
    survivors = group_alive(proc.pid, wait=10.0)
    return {"seconds": seconds, "killed": killed, "returncode": proc.returncode,
            "survivors": survivors}  # fmt: skip


def group_alive(pgid: int, wait: float) -> bool:
    """Whether a process of the group is still there after `wait` s (orphans are reaped by init)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# What an output holds


def shard_digests(output: str) -> dict[str, str]:
    return {os.path.relpath(path, output): scale.file_sha256([path])
            for path in sorted(glob.glob(os.path.join(output, "*", "*.arrow")))}


def work_on_disk(output: str) -> tuple[int, int]:
    """(bundles, stages) the work folder records as done (pipelines/local/work_dir.py)."""
    work = os.path.join(output, WORK_DIR_NAME)
    bundles = len(glob.glob(os.path.join(work, "*", "b*.json")))
    return bundles, len(glob.glob(os.path.join(work, "*", "stage.json")))


def leftovers(output: str) -> list[str]:
    """What a finished run must not leave: its work folder, temporary pieces or shards."""
    found = [WORK_DIR_NAME] if os.path.exists(os.path.join(output, WORK_DIR_NAME)) else []
    for path in glob.glob(os.path.join(output, "**", "*"), recursive=True):
        if path.endswith(".tmp") or ".tmp-" in os.path.basename(path):
            found.append(os.path.relpath(path, output))
    return sorted(found)


def log_tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# One kill point


def code_changed(full: dict) -> str | None:
    """What to say when the job's code (its identity's `code`, pipelines/**/*.py) is no longer
    the full run's: an edit in the checkout while this runs voids the comparison."""
    now = code_digest()
    if now == full["code"]:
        return None
    return (f"the job's code (pipelines/**/*.py) changed since the full run ({full['code']} -> "
            f"{now}): someone edited the checkout; rerun on one nobody edits")


def kill_and_resume(fraction: float, full: dict, argv: list[str], output: str) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    os.makedirs(output)
    after = fraction * full["seconds"]
    row = {"fraction": fraction, "kill_seconds": after, "problems": []}
    if changed := code_changed(full):
        row["problems"].append(f"kill at {fraction:g}: not run: {changed}")
        return row
    log(f"kill at {fraction:g}: running into {output}, SIGKILL at {after:.1f} s")
    killed = run_and_kill(argv, output + ".killed.log", after)
    bundles, stages = work_on_disk(output)
    row.update(killed=killed, bundles_at_kill=bundles, stages_at_kill=stages)
    if not killed["killed"]:
        row["problems"].append(
            f"kill at {fraction:g}: not measured: the run ended (exit {killed['returncode']}) "
            f"after {killed['seconds']:.1f} s, before the kill, faster than the full run's "
            f"{full['seconds']:.1f} s (the machine's load changed?)")
        return row
    if killed["survivors"]:
        row["problems"].append(f"kill at {fraction:g}: processes of the killed group still alive")
    if os.path.exists(os.path.join(output, "manifest.json")):  # the last thing the job writes
        row["problems"].append(
            f"kill at {fraction:g}: not measured: the run had finished its work before the kill "
            f"(manifest.json written, {WORK_DIR_NAME} removed; the kill at "
            f"{killed['seconds']:.1f} s only cut the process's exit): kill earlier")
        return row
    if changed := code_changed(full):  # the resume would refuse the work: another job's
        row["problems"].append(f"kill at {fraction:g}: the resume not run: {changed}")
        return row
    log(f"kill at {fraction:g}: killed after {killed['seconds']:.1f} s, {bundles} bundles "
        f"({stages} stages) on disk; resuming")
    resume = run_to_end(argv, output + ".resume.log")
    row["resume"] = resume
    match = CONTINUED.search(resume["log"])
    row["reused"], row["run_now"] = (int(match[1]), int(match[2])) if match else (None, None)
    row["identical"] = resume["returncode"] == 0 and shard_digests(output) == full["shards"]
    row["leftovers"] = leftovers(output)
    if resume["returncode"] != 0:
        row["problems"].append(f"kill at {fraction:g}: the resume exited {resume['returncode']}; "
                               f"its log ({resume['log_path']}) ends:\n{log_tail(resume['log'])}")
    elif not match and bundles:
        row["problems"].append(f"kill at {fraction:g}: the resume's log has no \"continued an "
                               f"earlier run\" line ({resume['log_path']})")
    elif match and row["reused"] < bundles:
        row["problems"].append(f"kill at {fraction:g}: the resume reused {row['reused']} bundles "
                               f"of the {bundles} done at the kill")
    if resume["returncode"] == 0 and not row["identical"]:
        got, want = shard_digests(output), full["shards"]
        differ = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        row["problems"].append(f"kill at {fraction:g}: shards differ from the full run's: "
                               f"{', '.join(differ)}")
    if row["leftovers"]:
        row["problems"].append(f"kill at {fraction:g}: left in the output after the resume: "
                               f"{', '.join(row['leftovers'][:10])}")
    log(f"kill at {fraction:g}: resume {resume['seconds']:.1f} s (R/W "
        f"{resume['seconds'] / full['seconds']:.2f}), reused/run {row['reused']}/{row['run_now']}, "
        f"identical: {row['identical']}")
    return row


# ---------------------------------------------------------------------------------------------
# The report


def table(corpus: dict, full: dict, rows: list[dict]) -> list[str]:
    lines = [
        "| corpus MB (files) | kill at: fraction (s) | full wall W s | killed run s (bundles "
        "done at the kill; stages) | resume wall R s | R/W | bundles reused / run | "
        "shards identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        killed, resume = row.get("killed"), row.get("resume")
        if killed is None:
            lines.append(f"| {corpus['bytes'] / MB:.1f} ({corpus['files']}) | {row['fraction']:g} "
                         f"({row['kill_seconds']:.1f}) | {full['seconds']:.1f} | not run | - | - | "
                         "- | - |")  # fmt: skip
            continue
        if resume is None:
            resumed = "- | - | - | -"
        else:
            reused = "-" if row["reused"] is None else f"{row['reused']} / {row['run_now']}"
            if row["reused"] is None and not row["bundles_at_kill"]:
                reused = "none done at the kill: a fresh run"
            r_w = resume["seconds"] / full["seconds"]
            marked = f"**{r_w:.2f}**" if in_target_range(row["fraction"]) else f"{r_w:.2f}"
            resumed = (f"{resume['seconds']:.1f} | {marked} | {reused} | "
                       f"{'yes' if row['identical'] else 'no'}")  # fmt: skip
        lines.append(
            f"| {corpus['bytes'] / MB:.1f} ({corpus['files']}) | {row['fraction']:g} "
            f"({row['kill_seconds']:.1f}) | {full['seconds']:.1f} | {killed['seconds']:.1f} "
            f"({done_at_kill(row)}) | {resumed} |"
        )  # fmt: skip
    return lines


def done_at_kill(row: dict) -> str:
    """Where the kill really landed: the bundles done, of all the job's (the resume's reused +
    run now), and the stages complete. The wall-time fraction is the full run's: on a busy
    machine the killed run can be further along, or behind."""
    text = f"{row['bundles_at_kill']}"
    if row.get("reused") is not None:
        total = row["reused"] + row["run_now"]
        text += f" of {total} = {row['bundles_at_kill'] / total:.0%}"
    return f"{text}; {row['stages_at_kill']} stages complete"


def in_target_range(fraction: float) -> bool:
    return TARGET_KILL_AT[0] <= fraction <= TARGET_KILL_AT[1]


def verdict_lines(full: dict, rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if in_target_range(row["fraction"]) and row.get("resume"):
            r_w = row["resume"]["seconds"] / full["seconds"]
            ok = r_w < R_OVER_W_TARGET and row["identical"] and not row["problems"]
            lines.append(f"- issue 23 item 5, kill at {row['fraction']:g}: R/W **{r_w:.2f}** "
                         f"(target < {R_OVER_W_TARGET:.2f}): {'met' if ok else 'missed'}")
    return lines


def report(args, header: list[str], corpus: dict, full: dict, rows: list[dict]) -> list[str]:
    job = f"bertforge prepare --direct_num_workers 2 --direct_running_mode multi_processing " \
        f"{args.prepare_args}"  # fmt: skip
    documents = f", {corpus['documents']:,} documents" if corpus["documents"] else ""
    lines = ["# bertforge prepare: resuming after a kill -9", "", *header,
             f"- job: `{job.strip()}`, vocab `{args.vocab}`",
             f"- corpus: {corpus['name']}: {corpus['bytes'] / MB:.1f} MB, {corpus['files']} "
             f"files{documents}; MB = 10^6 bytes",
             f"- full run: {full['seconds']:.1f} s, {len(full['shards'])} shards; the job's "
             f"code digest {full['code']} (pipelines/local_job.py's code_digest)",
             f"- load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}",
             "", *table(corpus, full, rows), "", *verdict_lines(full, rows)]  # fmt: skip
    problems = [p for row in rows for p in row["problems"]]
    if problems:
        lines += ["", "Failed checks:", *[f"- {p}" for p in problems]]
    return lines


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--size-gb", type=float, default=0.15,
                        help="generated corpus size, GB of JSON Lines (prepare_at_scale.py's)")
    source.add_argument("--input", nargs="+", help="the corpus's files instead (as prepare's "
                        "--input: globs and a format: prefix allowed)")  # fmt: skip
    parser.add_argument("--kill-at", type=float, nargs="+", default=[0.8],
                        help="fractions of the full run's wall time at which to kill")
    parser.add_argument("--work-dir", default="/tmp/bertforge-prepare-at-scale")
    parser.add_argument("--vocab", help="vocab.txt (default: ../shared/data's BERT uncased one, "
                        "else one trained on the generated corpus)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of the generated corpus")
    parser.add_argument("--file-mb", type=float, default=64, help="MB per generated corpus file")
    parser.add_argument("--prepare-args", default="", help="more flags for bertforge prepare")
    parser.add_argument("--keep", action="store_true", help="keep the outputs and their logs")
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args()
    if any(not 0 < f < 1 for f in args.kill_at):
        parser.error("--kill-at: fractions between 0 and 1")
    if not os.access(BERTFORGE, os.X_OK):
        raise SystemExit(f"{BERTFORGE} not found: run `make install` first")
    os.makedirs(args.work_dir, exist_ok=True)
    header = scale.machine_lines()
    if args.vocab is None and os.path.isfile(scale.SHARED_VOCAB):
        args.vocab = os.path.normpath(scale.SHARED_VOCAB)
    if args.vocab is not None:
        args.vocab = os.path.abspath(args.vocab)  # the command runs in the repository root
    if args.input:
        if args.vocab is None:
            raise SystemExit("--input needs --vocab (../shared/data has no vocabulary here)")
        corpus = input_corpus(args.input)
    else:
        corpus = generated_corpus(args)
    tag = f"{args.size_gb:g}GB" if not args.input else "input"
    extra = shlex.split(args.prepare_args)

    full_out = os.path.join(args.work_dir, f"out-resume-{tag}-full")
    shutil.rmtree(full_out, ignore_errors=True)
    os.makedirs(full_out)
    argv = prepare_argv(corpus, full_out, args.vocab, extra)
    log(f"full run on {corpus['bytes'] / MB:.1f} MB -> {full_out}")
    code = code_digest()
    full = run_to_end(argv, full_out + ".log")
    full["code"] = code
    if changed := code_changed(full):
        raise SystemExit(changed)
    if full["returncode"] != 0:
        raise SystemExit(f"the full run exited {full['returncode']}:\n{log_tail(full['log'], 40)}")
    full["shards"] = shard_digests(full_out)
    log(f"full run: {full['seconds']:.1f} s, {len(full['shards'])} shards")

    rows = []
    for fraction in args.kill_at:
        output = os.path.join(args.work_dir, f"out-resume-{tag}-kill{fraction:g}")
        argv = prepare_argv(corpus, output, args.vocab, extra)
        rows.append(kill_and_resume(fraction, full, argv, output))
        if not args.keep and not rows[-1]["problems"]:  # a failed one is kept to look at
            shutil.rmtree(output, ignore_errors=True)
            for suffix in (".killed.log", ".resume.log"):
                os.remove(output + suffix)
    if not args.keep:
        shutil.rmtree(full_out, ignore_errors=True)
        os.remove(full_out + ".log")

    lines = report(args, header, corpus, full, rows)
    print("\n".join(lines))
    if args.out:
        scale.write_report(args.out, lines, __file__)
    if any(row["problems"] for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
