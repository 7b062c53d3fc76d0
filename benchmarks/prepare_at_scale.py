"""Memory, speed and disk of a local `bertforge prepare` as the corpus grows, against Hugging Face
`datasets` tokenizing the same corpus (issue 23, item 1).

For each --sizes (GB of JSON Lines, default 0.15 0.6 2.4):
1. a synthetic corpus of distinct documents is generated, reproducibly (same seed, same vocabulary
   -> same bytes; its sha256 is printed), under --work-dir, split into ~--file-mb MB files, and
   reused when already there with the right size and hash. Documents are seeded random sentences
   of 5-30 words drawn Zipf-like from the vocabulary's whole words (and some made-up compounds of
   a word and a `##` piece, so WordPiece splits words too), capitalised, punctuated, paragraphs on
   blank lines; a few hundred bytes to 50 KB each (Wikipedia-like, log-normal), and one in 2,000
   a book of 0.6-1.5 MB. Nothing is committed: the corpora are made at each run's first use;
2. the real command runs on it: `bertforge prepare --input FILES --output DIR --vocab VOCAB
   --direct_num_workers 2 --direct_running_mode multi_processing` (+ --prepare-args);
3. the reference, in the same run, on the same files: `datasets.load_dataset("json")` and
   `Dataset.map(batched=True, num_proc=2)` with a `tokenizers` BertWordPieceTokenizer of the same
   vocabulary (lower-cased), its Arrow cache under --work-dir. `datasets` lives in a venv of its
   own (--reference-venv, created with `python3 -m venv` + pip when missing), never in the
   project's.

Each run is a child process measured from outside: wall seconds; CPU seconds of the whole process
tree (`os.wait4` on the child: its rusage includes every descendant it reaped; the sum of the
last CPU times sampled per process beside it as a cross-check); peak RSS of the whole tree (the
sum over the tree at each sample, every --interval s, children recursively; the sum of PSS beside
it, which counts pages the processes share once) and of its largest process (wait4's ru_maxrss
beside it); peak disk under the output directory (sampled, `du`-like
allocated blocks) and, apart, its hidden work folders (e.g. `.prepare-work`, where a runner
spills); the final output's size; instances (manifest.json) or rows. MB = 10^6 bytes.

Then a markdown table with the machine (CPU, cores, memory, vector extensions), the date and the
commit, and derived lines: the peak-RSS ratio of the largest to the smallest size (issue target:
<= 1.2x from 0.15 to 2.4 GB, and < 2.5 GB at every size), the wall-time ratio of the largest size
to the one about 4x smaller (target <= 1.1x the data ratio: 4.4x for 2.4/0.6), and a projection to
20 GB (linear from the largest size).

    .venv/bin/python benchmarks/prepare_at_scale.py [--sizes 0.15 0.6 2.4] [--work-dir DIR]
        [--vocab vocab.txt] [--prepare-args "--num_shards 8"] [--skip-reference] [--keep]
        [--out benchmarks/results/prepare_at_scale_MACHINE_DATE.md]

Without --vocab: ../shared/data/bert-base-uncased-vocab.txt, else a vocabulary trained with
`bertforge vocab` on the first 20 MB of the corpus (whose words are then made-up syllables).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERTFORGE = os.path.join(REPO, ".venv", "bin", "bertforge")
SHARED_VOCAB = os.path.join(REPO, "..", "shared", "data", "bert-base-uncased-vocab.txt")
GENERATOR_VERSION = 1  # bump when the generator's output changes: corpora on disk are remade
MB = 1e6

# Corpus shape.
SENTENCE_WORDS = (5, 30)  # words per sentence, uniform, inclusive
COMMA_SHARE = 0.06  # of words not ending a sentence
PARAGRAPH_END_SHARE = 0.2  # of sentences: ~5 sentences a paragraph
END_PUNCTUATION = (0.9, 0.06, 0.04)  # . ? !
DOC_MEDIAN_BYTES, DOC_SIGMA, DOC_BYTES = 2500, 1.0, (300, 50_000)  # Wikipedia-like, log-normal
BOOK_SHARE, BOOK_BYTES = 1 / 2000, (600_000, 1_500_000)  # of documents; uniform size
DOCS_PER_BATCH = 256
ZIPF_EXPONENT, ZIPF_OFFSET = 1.07, 1.0  # p(rank r) ~ 1 / (r + offset) ** exponent
COMPOUND_SHARE = 0.3  # made-up compounds (a whole word + a ## piece), per vocabulary whole word
VOCAB_TRAIN_GB = 0.02  # without a vocabulary: the corpus prefix `bertforge vocab` trains on

# Suffixes after a word, as JSON-escaped bytes (a paragraph break is "\n\n" in the text).
SUFFIXES = [b" ", b", "] + [p + s for s in (b" ", b"\\n\\n") for p in (b".", b"?", b"!")]
SUFFIXES += [b".", b"?", b"!"]  # a document's last word
SPACE, COMMA, SENTENCE_END, DOC_END = 0, 1, 2, 8  # codes: SENTENCE_END + punct + 3 * paragraph

REFERENCE_PACKAGES = ["datasets", "tokenizers", "psutil"]
REFERENCE_SCRIPT = '''"""The reference: Hugging Face datasets tokenizing JSON Lines, Dataset.map."""
import argparse, json, time

import datasets
import tokenizers
from tokenizers import BertWordPieceTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--vocab", required=True)
parser.add_argument("--cache-dir", required=True)
parser.add_argument("--num-proc", type=int, default=2)
parser.add_argument("files", nargs="+")
args = parser.parse_args()
tokenizer = BertWordPieceTokenizer(args.vocab, lowercase=True)


def encode(batch):
    ids = [e.ids for e in tokenizer.encode_batch(batch["text"])]
    return {"input_ids": ids, "num_tokens": [len(i) for i in ids]}


start = time.perf_counter()
raw = datasets.load_dataset("json", data_files=args.files, split="train", cache_dir=args.cache_dir)
loaded = time.perf_counter()
encoded = raw.map(encode, batched=True, num_proc=args.num_proc, remove_columns=raw.column_names)
mapped = time.perf_counter()
print(json.dumps({
    "datasets": datasets.__version__, "tokenizers": tokenizers.__version__,
    "rows": len(encoded), "tokens": int(sum(encoded["num_tokens"])),
    "load_seconds": loaded - start, "map_seconds": mapped - loaded,
}))
'''


# ---------------------------------------------------------------------------------------------
# The machine


def command_output(argv: list[str], cwd: str = REPO) -> str:
    try:
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_lines() -> list[str]:
    lscpu = command_output(["lscpu"])
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    extensions = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", lscpu)))
    if not extensions:
        extensions = ["AVX2 only" if re.search(r"\bavx2\b", lscpu) else "no AVX2"]
    commit = command_output(["git", "rev-parse", "--short", "HEAD"]).strip() or "unknown"
    changed = command_output(["git", "status", "--porcelain", "--untracked-files=no"]).splitlines()
    if changed:
        commit += f" + uncommitted changes in {len(changed)} tracked files (measured as they are)"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"- machine: {model.group(1) if model else platform.processor()}, "
        f"{os.cpu_count()} cores (nproc {command_output(['nproc']).strip()}), "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB memory, "
        f"vector extensions: {' '.join(extensions)}",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; commit: {commit}",
        f"- load average at the start: {load} (a shared machine makes wall times noisy)",
    ]


# ---------------------------------------------------------------------------------------------
# The corpus


def read_words(vocab: str | None, seed: int) -> tuple[list[str], str]:
    """Words in Zipf rank order and where they came from: the vocabulary's whole words (its order
    is roughly by frequency) with made-up compounds of a word and a ## piece among the rarer ones;
    without a vocabulary, made-up syllable words."""
    rng = np.random.default_rng([seed, 1])
    if vocab is None:
        syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "st", "er"]
        lengths = rng.integers(1, 5, 30_000)
        picks = rng.integers(0, len(syllables), (30_000, 4))
        made_up = {"".join(syllables[i] for i in p[:n])
                   for p, n in zip(picks, lengths, strict=True)}  # fmt: skip
        words = sorted(made_up, key=lambda w: (len(w), w))  # short words the most frequent
        return words, "made-up syllable words"
    with open(vocab, encoding="utf-8") as f:
        tokens = [line.rstrip("\n") for line in f]
    whole = [t for t in tokens if re.fullmatch(r"[a-z]{2,}", t)]
    if "a" in tokens:
        whole.insert(min(4, len(whole)), "a")  # BERT's vocab has it only among the characters
    pieces = [t[2:] for t in tokens if re.fullmatch(r"##[a-z]+", t)]
    if not whole:
        raise SystemExit(f"{vocab}: no lower-case whole-word entries to draw sentences from")
    compounds = []
    if pieces:
        n = int(len(whole) * COMPOUND_SHARE)
        heads = rng.integers(0, len(whole), n)
        tails = rng.integers(0, len(pieces), n)
        made_up = {whole[h] + pieces[t] for h, t in zip(heads, tails, strict=True)}
        compounds = sorted(made_up - set(whole))
    rare_start = min(1000, len(whole))  # compounds: among the rarer words, denser to the end
    rare = whole[rare_start:]
    keys = np.r_[np.arange(len(rare)), np.sqrt(rng.random(len(compounds))) * len(rare)]
    merged = rare + compounds
    ranked = whole[:rare_start] + [merged[i] for i in np.argsort(keys, kind="stable")]
    source = f"{len(whole)} whole words of {os.path.basename(vocab)} + {len(compounds)} compounds"
    return ranked, source


class CorpusGenerator:
    """Seeded documents as JSON Lines bytes, a batch of documents at a time, vectorized."""

    def __init__(self, words: list[str], seed: int):
        self._rng = np.random.default_rng([seed, 2])
        atoms = [w.encode() for w in words] + SUFFIXES
        self._blob = np.frombuffer(b"".join(atoms), dtype=np.uint8)
        self._len = np.array([len(a) for a in atoms], dtype=np.int64)
        self._off = np.cumsum(self._len) - self._len
        self._num_words = len(words)
        weights = 1.0 / (np.arange(len(words)) + 1 + ZIPF_OFFSET) ** ZIPF_EXPONENT
        self._cdf = np.cumsum(weights / weights.sum())
        mean_word = float((weights / weights.sum()) @ self._len[: len(words)])
        self._sentence_bytes = (sum(SENTENCE_WORDS) / 2) * (mean_word + 1)
        self.num_docs = 0

    def _doc_sentences(self) -> np.ndarray:
        rng, n = self._rng, DOCS_PER_BATCH
        wiki = np.clip(rng.lognormal(np.log(DOC_MEDIAN_BYTES), DOC_SIGMA, n), *DOC_BYTES)
        books = rng.uniform(*BOOK_BYTES, n)
        size = np.where(rng.random(n) < BOOK_SHARE, books, wiki)
        return np.maximum(2, np.rint(size / self._sentence_bytes)).astype(np.int64)

    def batch(self) -> list[bytes]:
        """The next DOCS_PER_BATCH documents, each a JSON line."""
        rng = self._rng
        doc_sentences = self._doc_sentences()
        num_sentences = int(doc_sentences.sum())
        sentence_words = rng.integers(SENTENCE_WORDS[0], SENTENCE_WORDS[1] + 1, num_sentences)
        num_words = int(sentence_words.sum())
        words = np.minimum(np.searchsorted(self._cdf, rng.random(num_words)), self._num_words - 1)
        suffix = np.where(rng.random(num_words) < COMMA_SHARE, COMMA, SPACE)
        last_word = np.cumsum(sentence_words) - 1
        punct = rng.choice(3, num_sentences, p=END_PUNCTUATION)
        last_sentence = np.cumsum(doc_sentences) - 1
        paragraph = rng.random(num_sentences) < PARAGRAPH_END_SHARE
        paragraph[last_sentence] = False
        code = SENTENCE_END + punct + 3 * paragraph
        code[last_sentence] = DOC_END + punct[last_sentence]
        suffix[last_word] = code
        atoms = np.empty(2 * num_words, dtype=np.int64)
        atoms[0::2], atoms[1::2] = words, self._num_words + suffix
        text, starts, ends = self._gather(atoms)
        first_byte = starts[2 * (last_word - sentence_words + 1)]
        text[first_byte] -= 32  # capitalise each sentence: every word starts with a-z
        doc_ends = ends[2 * last_word[last_sentence] + 1]
        doc_starts = np.r_[0, doc_ends[:-1]]
        data = text.tobytes()
        lines = []
        for start, end in zip(doc_starts.tolist(), doc_ends.tolist(), strict=True):
            head = b'{"id": "synthetic-%d", "text": "' % self.num_docs
            lines.append(head + data[start:end] + b'"}\n')
            self.num_docs += 1
        return lines

    def _gather(self, atoms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The atoms' bytes one after another, and where each atom starts and ends."""
        lengths = self._len[atoms]
        ends = np.cumsum(lengths)
        starts = ends - lengths
        index = np.repeat(self._off[atoms] - starts, lengths) + np.arange(ends[-1])
        return self._blob[index], starts, ends


def corpus_dir(work_dir: str, size_gb: float, seed: int, words: list[str]) -> str:
    tag = hashlib.sha256("\n".join(words).encode()).hexdigest()[:8]
    return os.path.join(work_dir, f"corpus-{size_gb:g}GB-seed{seed}-words{tag}")


def file_sha256(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def existing_corpus(directory: str, size_gb: float, seed: int) -> dict | None:
    """The corpus in `directory` if complete: the same generator, sizes and sha256."""
    try:
        with open(os.path.join(directory, "corpus.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if (meta.get("generator"), meta.get("size_gb"), meta.get("seed")) != (
        GENERATOR_VERSION, size_gb, seed):  # fmt: skip
        return None
    paths = [os.path.join(directory, name) for name in meta["files"]]
    if any(not os.path.isfile(p) for p in paths):
        return None
    if [os.path.getsize(p) for p in paths] != meta["file_bytes"]:
        return None
    if file_sha256(paths) != meta["sha256"]:
        return None
    return dict(meta, paths=paths, directory=directory, reused=True, seconds=0.0)


def generate_corpus(directory: str, size_gb: float, seed: int, words: list[str],
                    file_mb: float) -> dict:  # fmt: skip
    """Writes the corpus (JSON Lines, ~file_mb MB files) and its corpus.json, written last."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    start = time.perf_counter()
    generator = CorpusGenerator(words, seed)
    target, total, digest = int(size_gb * 1e9), 0, hashlib.sha256()
    names, file_bytes, f, num_docs = [], [], None, 0
    while total < target:
        for line in generator.batch():
            if f is None or file_bytes[-1] >= file_mb * MB:
                if f is not None:
                    f.close()
                names.append(f"part-{len(names):05d}.jsonl")
                file_bytes.append(0)
                f = open(os.path.join(directory, names[-1]), "wb")  # noqa: SIM115
            f.write(line)
            digest.update(line)
            file_bytes[-1] += len(line)
            total += len(line)
            num_docs += 1
            if total >= target:
                break
    f.close()
    meta = {"generator": GENERATOR_VERSION, "size_gb": size_gb, "seed": seed,
            "files": names, "file_bytes": file_bytes, "bytes": total,
            "documents": num_docs, "sha256": digest.hexdigest()}  # fmt: skip
    with open(os.path.join(directory, "corpus.json"), "w") as out:
        json.dump(meta, out, indent=1)
    seconds = time.perf_counter() - start
    paths = [os.path.join(directory, n) for n in names]
    return dict(meta, paths=paths, directory=directory, reused=False, seconds=seconds)


def ensure_corpus(work_dir: str, size_gb: float, seed: int, words: list[str],
                  file_mb: float) -> dict:  # fmt: skip
    directory = corpus_dir(work_dir, size_gb, seed, words)
    corpus = existing_corpus(directory, size_gb, seed)
    if corpus is None:
        corpus = generate_corpus(directory, size_gb, seed, words, file_mb)
    verb = "reused" if corpus["reused"] else f"generated in {corpus['seconds']:.1f} s"
    rate = f", {corpus['seconds'] / corpus['bytes'] * 1e9:.0f} s/GB" if not corpus["reused"] else ""
    log(f"corpus {size_gb:g} GB: {corpus['bytes'] / MB:.1f} MB, {corpus['documents']:,} documents, "
        f"{len(corpus['paths'])} files, {verb}{rate}; sha256 {corpus['sha256']}")  # fmt: skip
    return corpus


def trained_vocab(work_dir: str, seed: int, words: list[str], file_mb: float) -> str:
    """A vocabulary trained by `bertforge vocab` on the corpus's first VOCAB_TRAIN_GB (the same
    seed makes a smaller corpus the prefix of every larger one)."""
    corpus = ensure_corpus(work_dir, VOCAB_TRAIN_GB, seed, words, file_mb)
    out = os.path.join(work_dir, f"vocab-{os.path.basename(corpus['directory'])}")
    vocab = os.path.join(out, "vocab.txt")
    if not os.path.isfile(vocab):
        log(f"training a vocabulary on {corpus['bytes'] / MB:.0f} MB: {out}")
        subprocess.run([BERTFORGE, "vocab", "--input", *corpus["paths"], "--output", out],
                       check=True, cwd=REPO)  # fmt: skip
    return vocab


# ---------------------------------------------------------------------------------------------
# Measuring a process tree


def disk_bytes(path: str) -> int:
    """Allocated bytes under `path`, like `du` (files may vanish while we walk)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def hidden_dirs(path: str) -> list[str]:
    """Top-level hidden folders of an output directory: where a runner spills (`.prepare-work`)."""
    try:
        return [e.path for e in os.scandir(path) if e.name.startswith(".") and e.is_dir()]
    except OSError:
        return []


class TreeSampler(threading.Thread):
    """Every `interval` s: RSS of each process of the tree under `pid` (peak of the sum, peak of
    the largest; peak of the sum of PSS), the CPU seconds last seen per process, and the disk
    used under `disk_dir` (all of it, and its hidden work folders apart)."""

    def __init__(self, pid: int, interval: float, disk_dir: str):
        super().__init__(daemon=True)
        self._root, self._interval, self._disk_dir = psutil.Process(pid), interval, disk_dir
        self.max_tree = self.max_tree_pss = self.max_process = 0
        self.max_disk = self.max_work_disk = 0
        self.work_dirs: set[str] = set()
        self.samples = 0
        self._cpu: dict[int, float] = {}
        self._done = threading.Event()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())

    def run(self) -> None:
        while not self._done.is_set():
            self._sample_memory()
            work = hidden_dirs(self._disk_dir)
            self.work_dirs.update(os.path.basename(w) for w in work)
            self.max_disk = max(self.max_disk, disk_bytes(self._disk_dir))
            self.max_work_disk = max(self.max_work_disk, sum(disk_bytes(w) for w in work))
            self.samples += 1
            self._done.wait(self._interval)

    def _sample_memory(self) -> None:
        try:
            procs = [self._root] + self._root.children(recursive=True)
        except psutil.Error:
            return
        rss, pss = [], []
        for p in procs:
            try:
                with p.oneshot():
                    memory = p.memory_full_info()  # smaps_rollup: well under 1 ms a process
                    times = p.cpu_times()
                rss.append(memory.rss)
                pss.append(memory.pss)
                self._cpu[p.pid] = times.user + times.system
            except psutil.Error:
                pass
        self.max_tree = max(self.max_tree, sum(rss))
        self.max_tree_pss = max(self.max_tree_pss, sum(pss))
        self.max_process = max(self.max_process, max(rss, default=0))

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_measured(argv: list[str], env: dict, log_base: str, disk_dir: str,
                 interval: float) -> dict:  # fmt: skip
    """Runs `argv`, stdout and stderr to `log_base`.out/.err; wall, CPU, memory and disk."""
    start = time.perf_counter()
    with open(log_base + ".out", "wb") as out, open(log_base + ".err", "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=REPO)
    sampler = TreeSampler(proc.pid, interval, disk_dir)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)  # reaps it: rusage of it and its reaped descendants
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop()
    with open(log_base + ".err", encoding="utf-8", errors="replace") as f:
        stderr = f.read()
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}:\n{stderr[-4000:]}")
    with open(log_base + ".out", encoding="utf-8", errors="replace") as f:
        stdout = f.read()
    return {
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "sampled_cpu_seconds": sampler.cpu_seconds,
        "max_tree_mb": sampler.max_tree / MB,
        "max_tree_pss_mb": sampler.max_tree_pss / MB,
        "max_process_mb": sampler.max_process / MB,
        "maxrss_mb": usage.ru_maxrss * 1024 / MB,  # Linux: KiB, the largest process reaped
        "max_disk_mb": sampler.max_disk / MB,
        "max_work_disk_mb": sampler.max_work_disk / MB,
        "work_dirs": sorted(sampler.work_dirs),
        "final_disk_mb": disk_bytes(disk_dir) / MB,
        "samples": sampler.samples,
        "stdout": stdout,
        "notes": notable_lines(stderr),
    }


def notable_lines(stderr: str, limit: int = 8) -> list[str]:
    """Distinct warning and error lines of a run's log, timestamps dropped."""
    seen: dict[str, None] = {}
    for line in stderr.splitlines():
        if re.search(r"WARNING|ERROR|Warning|Error|Traceback", line):
            seen[re.sub(r"^[\d\-: ,.]+", "", line).strip()[:300]] = None
    return list(seen)[:limit] + ([f"... {len(seen) - limit} more"] if len(seen) > limit else [])


# ---------------------------------------------------------------------------------------------
# The job and the reference


def run_job(corpus: dict, vocab: str, extra: list[str], work_dir: str, interval: float,
            baseline: str | None = None) -> dict:
    """The job of this checkout, or of --baseline-checkout (another version, the same command)."""
    name = "baseline" if baseline else "prepare"
    output = os.path.join(work_dir, f"out-{corpus['size_gb']:g}GB-{name}")
    shutil.rmtree(output, ignore_errors=True)
    os.makedirs(output)
    env, command = dict(os.environ), [BERTFORGE]
    if baseline:  # that checkout's `bertforge` first on the path, in the workers too
        link_dir = os.path.join(work_dir, "baseline-path")
        os.makedirs(link_dir, exist_ok=True)
        link = os.path.join(link_dir, "bertforge")
        if os.path.islink(link):
            os.remove(link)
        os.symlink(os.path.abspath(baseline), link)
        env["PYTHONPATH"] = link_dir
        command = [sys.executable, "-m", "bertforge.cluster.cli"]
    argv = [*command, "prepare", *[a for p in corpus["paths"] for a in ("--input", p)],
            "--output", output, "--vocab", vocab, "--direct_num_workers", "2",
            "--direct_running_mode", "multi_processing", *extra]  # fmt: skip
    log(f"running bertforge prepare ({name}) on {corpus['bytes'] / MB:.1f} MB -> {output}")
    result = run_measured(argv, env, output + ".log", output, interval)
    with open(os.path.join(output, "manifest.json")) as f:
        counts = json.load(f)["counts"]
    tool = f"bertforge prepare, baseline {os.path.basename(baseline.rstrip('/'))}" if baseline \
        else "bertforge prepare"
    result.update(tool=tool, rows=counts["instances"], output=output,
                  rows_name="instances", documents_kept=counts.get("documents"))  # fmt: skip
    return result


def ensure_reference_venv(venv: str) -> str:
    """The reference's python, in a venv of its own (created and filled with pip if missing)."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import datasets, tokenizers, psutil"]
    if os.path.isfile(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log(f"creating the reference venv {venv} (pip install {' '.join(REFERENCE_PACKAGES)})")
    base = shutil.which("python3") or sys.executable
    subprocess.run([base, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *REFERENCE_PACKAGES], check=True)
    return python


def run_reference(python: str, corpus: dict, vocab: str, work_dir: str, interval: float) -> dict:
    cache = os.path.join(work_dir, f"out-{corpus['size_gb']:g}GB-datasets-cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    script = os.path.join(work_dir, "reference_map.py")
    with open(script, "w") as f:
        f.write(REFERENCE_SCRIPT)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HOME=os.path.join(work_dir, "hf-home"),
               HF_DATASETS_CACHE=cache)  # fmt: skip
    env.pop("PYTHONPATH", None)
    argv = [python, script, "--vocab", vocab, "--cache-dir", cache, "--num-proc", "2",
            *corpus["paths"]]  # fmt: skip
    log(f"running the reference (datasets map, num_proc=2) on {corpus['bytes'] / MB:.1f} MB")
    result = run_measured(argv, env, cache + ".log", cache, interval)
    summary = json.loads(result["stdout"].strip().splitlines()[-1])
    result.update(tool="datasets map (reference)", rows=summary["rows"], output=cache,
                  rows_name="rows", summary=summary)  # fmt: skip
    return result


def remove_output(result: dict) -> None:
    shutil.rmtree(result["output"], ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The report


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def table(rows: list[tuple]) -> list[str]:
    lines = [
        "| size GB (MB) | documents | tool | wall s | CPU s (sampled) | CPU s/MB | "
        "peak tree RSS MB (PSS) | peak largest process MB (ru_maxrss) | peak disk MB (work dir) | "
        "output MB | rows out | x reference: wall / CPU / tree RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for corpus, job, ref, base in rows:
        for r in (job, base, ref):
            if r is None:
                continue
            mb = corpus["bytes"] / MB
            x_ref = "-"
            if ref is not None and r is job:
                x_ref = (f"{ratio(job['seconds'], ref['seconds'])} / "
                         f"{ratio(job['cpu_seconds'], ref['cpu_seconds'])} / "
                         f"{ratio(job['max_tree_mb'], ref['max_tree_mb'])}")  # fmt: skip
            work = f" ({r['max_work_disk_mb']:.0f})" if r["work_dirs"] else ""
            lines.append(
                f"| {corpus['size_gb']:g} ({mb:.0f}) | {corpus['documents']:,} | {r['tool']} | "
                f"{r['seconds']:.1f} | {r['cpu_seconds']:.1f} ({r['sampled_cpu_seconds']:.1f}) | "
                f"{r['cpu_seconds'] / mb:.2f} | "
                f"{r['max_tree_mb']:.0f} ({r['max_tree_pss_mb']:.0f}) | "
                f"{r['max_process_mb']:.0f} ({r['maxrss_mb']:.0f}) | "
                f"{r['max_disk_mb']:.0f}{work} | "
                f"{r['final_disk_mb']:.0f} | {r['rows']:,} {r['rows_name']} | {x_ref} |"
            )  # fmt: skip
    return lines


def derived_lines(rows: list[tuple]) -> list[str]:
    """Peak-RSS growth, wall-time growth, and the projection to 20 GB."""
    jobs = sorted(((c["bytes"], c, j) for c, j, _, _ in rows), key=lambda t: t[0])
    (_, small_c, small), (large_b, large_c, large) = jobs[0], jobs[-1]
    worst = max(j["max_tree_mb"] for _, _, j in jobs)
    lines = [
        f"- peak tree RSS, {large_c['size_gb']:g} GB / {small_c['size_gb']:g} GB: "
        f"**{large['max_tree_mb'] / small['max_tree_mb']:.2f}x** ({small['max_tree_mb']:.0f} -> "
        f"{large['max_tree_mb']:.0f} MB; target <= 1.2x); largest at any size {worst:.0f} MB "
        f"(target < 2500 MB: {'met' if worst < 2500 else 'missed'})",
    ]
    if len(jobs) > 1:
        # The smaller size whose ratio to the largest is closest to 4 (0.6 for 2.4 GB).
        mid_b, mid_c, mid = min(jobs[:-1], key=lambda t: abs(np.log(large_b / t[0] / 4)))
        data = large_b / mid_b
        wall = large["seconds"] / mid["seconds"]
        lines.append(
            f"- wall time, {large_c['size_gb']:g} GB / {mid_c['size_gb']:g} GB: **{wall:.2f}x** "
            f"for {data:.2f}x the data (target <= 1.1x the data: {1.1 * data:.2f}x; "
            f"{'met' if wall <= 1.1 * data else 'missed'})"
        )
    scale = 20e9 / large_b
    lines.append(
        f"- projection to 20 GB (linear from {large_c['size_gb']:g} GB): bertforge prepare "
        f"{large['seconds'] * scale / 3600:.1f} h wall, {large['cpu_seconds'] * scale / 3600:.1f} "
        f"CPU h, peak disk {large['max_disk_mb'] * scale / 1e3:.1f} GB, dataset "
        f"{large['final_disk_mb'] * scale / 1e3:.1f} GB"
    )  # fmt: skip
    if len(jobs) > 1:  # the marginal rate, without the fixed cost a small run is dominated by
        prev_b, _, prev = jobs[-2]
        slope = (large["seconds"] - prev["seconds"]) / (large_b - prev_b)
        lines[-1] += (f" (from the slope between the two largest sizes instead: "
                      f"{(large['seconds'] + slope * (20e9 - large_b)) / 3600:.1f} h wall)")
    ref = next((r for c, _, r, _ in rows if c is large_c), None)
    if ref is not None:
        lines[-1] += (f"; the reference {ref['seconds'] * scale / 3600:.1f} h wall, "
                      f"cache {ref['max_disk_mb'] * scale / 1e3:.1f} GB")  # fmt: skip
    for corpus, job, _, base in rows:
        if base is not None:
            lines.append(
                f"- against the baseline at {corpus['size_gb']:g} GB: CPU s/MB "
                f"**{ratio(job['cpu_seconds'], base['cpu_seconds'])}**, wall "
                f"{ratio(job['seconds'], base['seconds'])}, peak tree RSS "
                f"{ratio(job['max_tree_mb'], base['max_tree_mb'])} (target: CPU <= 1.10x)")
    return lines


def notes_lines(rows: list[tuple]) -> list[str]:
    lines = []
    for corpus, job, ref, base in rows:
        if job["documents_kept"] != corpus["documents"]:
            lines.append(f"- {corpus['size_gb']:g} GB: the job kept {job['documents_kept']:,} of "
                         f"{corpus['documents']:,} documents (duplicates or rejects)")  # fmt: skip
        for r in (job, base, ref):
            if r is not None and r["notes"]:
                lines.append(f"- {r['tool']}, {corpus['size_gb']:g} GB, its log's warnings:")
                lines += [f"    - `{n}`" for n in r["notes"]]
    return lines


def report(args, header: list[str], rows, reference_versions: str) -> list[str]:
    lines = ["# bertforge prepare at scale", "", *header]
    job = f"bertforge prepare --direct_num_workers 2 --direct_running_mode multi_processing " \
        f"{args.prepare_args}"  # fmt: skip
    lines.append(f"- job: `{job.strip()}`, vocab `{args.vocab}`")
    lines.append(f"- reference: {reference_versions}")
    lines.append(f"- corpus: {args.words_source}; seed {args.seed}; MB = 10^6 bytes of JSON Lines")
    lines.append(f"- memory sampled every {args.interval:g} s (psutil, the whole process tree)")
    lines.append(f"- load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    lines += ["", *table(rows), "", *derived_lines(rows)]
    work = sorted({w for _, job, _, _ in rows for w in job["work_dirs"]})
    if work:
        lines.append(f"- the job's hidden work folders in its output: {', '.join(work)} (their "
                     "peak in brackets in the disk column)")  # fmt: skip
    notes = notes_lines(rows)
    return lines + (["", *notes] if notes else [])


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.15, 0.6, 2.4],
                        help="corpus sizes in GB (10^9 bytes of JSON Lines)")  # fmt: skip
    parser.add_argument("--work-dir", default="/tmp/bertforge-prepare-at-scale")
    parser.add_argument("--vocab", help="vocab.txt (default: ../shared/data's BERT uncased one, "
                        "else one trained on the corpus)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--file-mb", type=float, default=64, help="MB per corpus file")
    parser.add_argument("--prepare-args", default="", help="more flags for bertforge prepare")
    parser.add_argument("--reference-venv", help="default: WORK_DIR/reference-venv")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the outputs (corpora are kept)")
    parser.add_argument("--interval", type=float, default=0.25, help="sampling period, s")
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("--baseline-checkout", help="another version's checkout (e.g. `git "
                        "archive REV | tar -x -C DIR`): its prepare runs on the same corpora, "
                        "before this one's, and the CPU s/MB ratio is printed")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    if not os.access(BERTFORGE, os.X_OK):
        raise SystemExit(f"{BERTFORGE} not found: run `make install` first")
    header = machine_lines()
    if args.vocab is None and os.path.isfile(SHARED_VOCAB):
        args.vocab = os.path.normpath(SHARED_VOCAB)
    words, args.words_source = read_words(args.vocab, args.seed)
    if args.vocab is None:
        args.vocab = trained_vocab(args.work_dir, args.seed, words, args.file_mb)
    python = versions = None
    if not args.skip_reference:
        python = ensure_reference_venv(args.reference_venv
                                       or os.path.join(args.work_dir, "reference-venv"))
    rows = []
    for size in sorted(args.sizes):
        corpus = ensure_corpus(args.work_dir, size, args.seed, words, args.file_mb)
        base = None
        if args.baseline_checkout:
            base = run_job(corpus, args.vocab, shlex.split(args.prepare_args), args.work_dir,
                           args.interval, baseline=args.baseline_checkout)
        job = run_job(corpus, args.vocab, shlex.split(args.prepare_args), args.work_dir,
                      args.interval)  # fmt: skip
        ref = None if python is None else run_reference(python, corpus, args.vocab,
                                                        args.work_dir, args.interval)
        if ref is not None:
            s = ref["summary"]
            versions = f"datasets {s['datasets']}, tokenizers {s['tokenizers']} ({python})"
        for r in (job, base, ref):
            if r is not None and not args.keep:
                remove_output(r)
        rows.append((corpus, job, ref, base))
        log(f"{size:g} GB: job {job['seconds']:.1f} s, {job['max_tree_mb']:.0f} MB tree RSS"
            + (f"; reference {ref['seconds']:.1f} s, {ref['max_tree_mb']:.0f} MB" if ref else ""))
    lines = report(args, header, rows, versions or "skipped (--skip-reference)")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, lines, __file__)


def write_report(path: str, lines: list[str], script: str) -> None:
    """The markdown, with the command line that made it under its title."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    command = shlex.join([os.path.relpath(sys.executable, REPO)
                          if sys.executable.startswith(REPO) else sys.executable,
                          os.path.relpath(os.path.abspath(script), REPO), *sys.argv[1:]])
    with open(path, "w") as f:
        f.write("\n".join(lines[:1] + ["", f"    {command}"] + lines[1:]) + "\n")


if __name__ == "__main__":
    main()
