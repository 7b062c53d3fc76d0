"""Preparation throughput against its bound, the tokenizer, on two corpora, and worker memory.

Two corpora, each measured in the same run against the tokenizer on the same text:
- *mixed*: many documents (the four Wikipedia excerpts and four books of ../shared/data, cleaned by
  the job's own readers and written as JSON Lines; replicated to --scale copies, each copy made
  distinct by a first sentence so that deduplication keeps it);
- *books*: long documents only (the four books, --books-scale distinct copies, one `books:` file
  each: 40 books, ~27 MB at 10 copies).
Without ../shared/data, both are synthetic (the docstring corpus, and long documents made of
it) with a vocabulary trained on it: the ratios mean the same, the MB/s differ.

Per corpus:
(a) the whole `prepare` job (DirectRunner, --workers processes): input MB/s per core and CPU
    seconds per MB, summed over the job's processes (with other load on the machine they show
    the work done, which wall time does not);
(b) the tokenizer alone (`encode_batch` on the same sentences, one process, measured before and
    after the job, averaged): MB/s and CPU seconds per MB;
(b') the tokenizer alone the cheaper way the job itself calls it (`encode_batch_fast` on the
    sentences joined at a marker, `pipelines.instances.sentence_ids`): CPU seconds per MB;
and (a)/(b): the share of the tokenizer's speed the job keeps (target >= 0.8), with and without
(c) the job's fixed cost (interpreter, Beam, worker start-up: the job on one document), which the
ratio pays once per run and a large corpus amortizes; by CPU also against (b').
With --in-process, (d): the same job in one process (Beam's in_memory mode, one worker thread),
CPU s/MB beyond its own fixed cost: the job's own work without Beam's worker processes, the gRPC
between them and their polling threads.

Then the peak memory of the job on 1x, each --mem-scale x and the --scale x corpus (RSS sampled
every 0.2 s with psutil): the largest worker process, the runner process (Beam's local runner,
which keeps every PCollection in memory: the part Dataflow's shuffle service plays there), and
the whole tree.

    python benchmarks/prepare_throughput.py [--scale 60] [--books-scale 10] [--mem-scale 10 30]
        [--workers 2] [--in-process] [--job-checkout DIR]
    (--mem-scale with no value: no memory runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from bertforge.pipelines.contract.tokenization import load_tokenizer, read_vocab
from bertforge.pipelines.instances.sentence_ids import (
    GROUP_CHARS,
    GROUPS_PER_CALL,
    MARKER,
    SentenceTokenizer,
    group_sentences,
)
from bertforge.pipelines.instances.sentences import split_sentences
from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.records import RawDocument

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared")
DATA = os.path.join(SHARED, "data")
DUMPS = [
    "enwiki-wikibrain-en_test.xml.bz2",
    "enwiki-pages-articles-sample.xml.bz2",
    "enwiki-table-markup.xml.bz2",
    "enwiki-20250201-tiny_dump.xml.bz2",
]
BOOKS = ["austen-emma.txt", "chesterton-brown.txt", "melville-moby_dick.txt"]
BOOKS += ["shakespeare-hamlet.txt"]
VOCAB = os.path.join(DATA, "bert-base-uncased-vocab.txt")
JOB_PATH = ""  # set by --job-checkout: a folder whose `bertforge` is that checkout


def cleaned_documents(names_and_formats) -> list[tuple[str, str]]:
    docs = []
    for names, fmt in names_and_formats:
        for name in names:
            for item in read_file(os.path.join(DATA, name), name, fmt, open_local):
                if isinstance(item, RawDocument):
                    docs.append((item.doc_id, item.text))
    return docs


def synthetic_documents(tmp: str) -> tuple[list, list, str]:
    """(many documents, long documents, vocab path) without ../shared/data: the docstring corpus
    as documents, and books made of 150 of its documents each; a vocabulary trained on it."""
    from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus
    from bertforge.pipelines.vocab import train_wordpiece_vocab
    from bertforge.pipelines.vocab_options import VocabConfig

    path = os.path.join(tmp, "docstrings.jsonl")
    write_docstring_corpus(path)
    with open(path, encoding="utf-8") as f:
        docs = [(r["doc_id"], r["text"]) for r in map(json.loads, f)]
    books = [
        (f"book-{i}", "\n\n".join(text for _, text in docs[i * 150 : (i + 1) * 150]))
        for i in range(max(1, len(docs) // 150))
    ]
    return docs, books, train_wordpiece_vocab(
        VocabConfig((path,), os.path.join(tmp, "vocab"), vocab_size=8000))


def write_corpus(docs: list[tuple[str, str]], scale: int, path: str) -> int:
    """JSON Lines of `scale` distinct copies; returns the bytes of text written."""
    num_bytes = 0
    with open(path, "w", encoding="utf-8") as f:
        for copy in range(scale):
            for doc_id, text in docs:
                text = f"This is copy number {copy} of the document.\n\n{text}"
                num_bytes += len(text.encode("utf-8"))
                f.write(json.dumps({"doc_id": f"{doc_id}#{copy}", "text": text}) + "\n")
    return num_bytes


def write_books(books: list[tuple[str, str]], scale: int, directory: str) -> int:
    """One plain-text file per distinct copy of each book; returns the bytes of text written."""
    os.makedirs(directory, exist_ok=True)
    num_bytes = 0
    for copy in range(scale):
        for name, text in books:
            text = f"This is copy number {copy} of the book.\n\n{text}"
            num_bytes += len(text.encode("utf-8"))
            with open(os.path.join(directory, f"{name}-{copy}.txt"), "w", encoding="utf-8") as f:
                f.write(text)
    return num_bytes


def corpus_sentences(docs: list[tuple[str, str]]) -> list[str]:
    return [s for _, text in docs for s in split_sentences(text)]


def tokenizer_alone(sentences: list[str], scale: int, vocab: str) -> dict:
    """MB/s and CPU s/MB of the tokenizer alone over the corpus's sentences, one process, two ways:
    (b) `encode_batch` on the sentences, as a user runs it; (b') the way the job runs it, cheaper:
    `encode_batch_fast` (no offsets) on the sentences joined at the job's marker in groups of
    `GROUP_CHARS` (`pipelines.instances.sentence_ids`), the tokenizer call only."""
    tokenizer = load_tokenizer(vocab, lower_case=True)
    joined_tokenizer = SentenceTokenizer(read_vocab(vocab), lower_case=True)._tokenizer
    joined = [MARKER.join(g) + MARKER for g in group_sentences(sentences, GROUP_CHARS)]
    num_bytes = sum(len(s.encode("utf-8")) for s in sentences) * scale
    os.environ["RAYON_NUM_THREADS"] = "1"  # per core: the job's workers get one thread each too

    def per_sentence() -> None:
        for i in range(0, len(sentences), 20_000):  # large batches: the tokenizer at its best
            tokenizer.encode_batch(sentences[i : i + 20_000], add_special_tokens=False)

    def joined_groups() -> None:
        for i in range(0, len(joined), GROUPS_PER_CALL):
            joined_tokenizer.encode_batch_fast(joined[i : i + GROUPS_PER_CALL],
                                               add_special_tokens=False)  # fmt: skip

    result = {}
    for key, run in (("", per_sentence), ("joined_", joined_groups)):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(scale):
            run()
        seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        result[key + "seconds"] = seconds
        result[key + "mb_s"] = num_bytes / seconds / 1e6
        result[key + "cpu_s_mb"] = cpu * 1e6 / num_bytes
    return result


class TreeSampler(threading.Thread):
    """Peak RSS of the largest process and of the whole tree under a pid, sampled."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self._root = psutil.Process(pid)
        self.max_process = self.max_root = self.max_tree = 0
        self._cpu: dict[int, float] = {}  # last CPU seconds seen per process
        self._done = threading.Event()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())

    @property
    def runner_cpu_seconds(self) -> float:
        """The root process's: Beam's local runner (the shuffle, bundles in and out)."""
        return self._cpu.get(self._root.pid, 0.0)

    def run(self) -> None:
        while not self._done.is_set():
            try:
                procs = [self._root] + self._root.children(recursive=True)
                rss = []
                for p in procs:
                    try:
                        rss.append(p.memory_info().rss)
                        times = p.cpu_times()
                        self._cpu[p.pid] = times.user + times.system
                    except psutil.Error:
                        pass
                self.max_process = max(self.max_process, max(rss[1:] or [0]))
                self.max_root = max(self.max_root, rss[0] if rss else 0)
                self.max_tree = max(self.max_tree, sum(rss))
            except psutil.Error:
                pass
            self._done.wait(0.2)

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_job(corpus: str, output: str, workers: int, vocab: str, mode="multi_processing") -> dict:
    """The job in a child process (`mode` in_memory: one process, one worker thread)."""
    argv = [
        sys.executable, "-m", "bertforge.pipelines.prepare", f"--input={corpus}",
        f"--output={output}",
        f"--vocab={vocab}", "--num_shards=4", "--max_seq_length=128", "--runner=DirectRunner",
        f"--direct_num_workers={workers if mode == 'multi_processing' else 1}",
        f"--direct_running_mode={mode}",
    ]  # fmt: skip
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if JOB_PATH:  # --job-checkout: that checkout's `bertforge` (first on the path) runs the job
        env["PYTHONPATH"] = os.pathsep.join(p for p in (JOB_PATH, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.stop()
    cpu_seconds, runner_cpu_seconds = sampler.cpu_seconds, sampler.runner_cpu_seconds
    if proc.returncode:
        raise RuntimeError(err.decode()[-3000:])
    seconds = time.perf_counter() - start
    summary = json.loads(out.decode()[out.decode().index("{") :])
    return {
        "seconds": seconds,
        "instances": summary["instances"],
        "max_worker_rss_mb": sampler.max_process / 1e6,
        "max_runner_rss_mb": sampler.max_root / 1e6,
        "max_tree_rss_mb": sampler.max_tree / 1e6,
        "cpu_seconds": cpu_seconds,
        "runner_cpu_seconds": runner_cpu_seconds,
    }


def measure(name: str, corpus: str, num_bytes: int, sentences, scale: int, args, tmp) -> dict:
    """(a) and (b) on one corpus: the tokenizer before and after the job, averaged."""
    before = tokenizer_alone(sentences, scale, args.vocab)
    job = run_job(corpus, os.path.join(tmp, f"out-{name.split()[0]}"), args.workers, args.vocab)
    if args.in_process:  # (d): the same job in one process, without Beam's worker processes
        out = os.path.join(tmp, f"out-{name.split()[0]}-in-process")
        job["in_process_cpu_seconds"] = run_job(corpus, out, 1, args.vocab, "in_memory")[
            "cpu_seconds"
        ]
    after = tokenizer_alone(sentences, scale, args.vocab)
    tok = {k: (before[k] + after[k]) / 2 for k in before}
    job["mb_s"] = num_bytes / job["seconds"] / args.workers / 1e6
    job["cpu_s_mb"] = job["cpu_seconds"] * 1e6 / num_bytes
    return {"name": name, "bytes": num_bytes, "job": job, "tokenizer": tok}


def _ratio(numerator: float, denominator: float) -> str:
    """numerator / denominator, or n/a where the job's own part (beyond its fixed cost) is not
    positive: a run shorter than the fixed-cost run measures noise, not throughput."""
    return f"{numerator / denominator:.2f}" if numerator > 0 and denominator > 0 else "n/a"


def print_throughput(results: list[dict], fixed: dict, workers: int) -> None:
    print(f"\nload average: {os.getloadavg()[0]:.1f} (a shared machine makes wall times noisy; "
          "CPU s/MB show the work)")  # fmt: skip
    print("| corpus | MB | (a) job s | (a) CPU s (runner) | (a) MB/s/core | (a) CPU s/MB | "
          "(b) tokenizer MB/s | (b) CPU s/MB | (b') joined CPU s/MB | **(a)/(b)** wall | "
          "without (c) | **by CPU, without (c): (b)** | (b') |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        job, tok = r["job"], r["tokenizer"]
        # The job's wall seconds beyond its fixed cost, per core and MB: n/a when not positive.
        variable_s = (job["seconds"] - fixed["seconds"]) * workers * 1e6 / r["bytes"]
        # CPU seconds per MB of the job beyond its fixed cost, against the tokenizer's: what the
        # ratio would be with every core busy, whatever else the machine runs.
        variable_cpu = (job["cpu_seconds"] - fixed["cpu_seconds"]) * 1e6 / r["bytes"]
        print(f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {job['seconds']:.1f} | "
              f"{job['cpu_seconds']:.1f} ({job['runner_cpu_seconds']:.1f}) | {job['mb_s']:.2f} | "
              f"{job['cpu_s_mb']:.2f} | {tok['mb_s']:.2f} | {tok['cpu_s_mb']:.2f} | "
              f"{tok['joined_cpu_s_mb']:.2f} | **{job['mb_s'] / tok['mb_s']:.2f}** | "
              f"{_ratio(1 / tok['mb_s'], variable_s)} | "
              f"**{_ratio(tok['cpu_s_mb'], variable_cpu)}** | "
              f"{_ratio(tok['joined_cpu_s_mb'], variable_cpu)} |")  # fmt: skip
    print(f"\n(c) the job on one document (fixed cost): {fixed['seconds']:.1f} s, "
          f"{fixed['cpu_seconds']:.1f} CPU s ({fixed['runner_cpu_seconds']:.1f} in the runner), "
          f"{workers} workers")  # fmt: skip


def print_in_process(results: list[dict], fixed: dict) -> None:
    """(d): CPU s/MB of the same job in one process beyond its own fixed cost, against (b)."""
    print("\n| corpus | (d) in-process CPU s | (d) CPU s/MB without its (c) | (b) CPU s/MB | "
          "(b)/(d) | (b')/(d) |\n|---|---|---|---|---|---|")  # fmt: skip
    for r in results:
        cpu, tok = r["job"]["in_process_cpu_seconds"], r["tokenizer"]
        variable = (cpu - fixed["cpu_seconds"]) * 1e6 / r["bytes"]
        ratios = _ratio(tok["cpu_s_mb"], variable), _ratio(tok["joined_cpu_s_mb"], variable)
        print(f"| {r['name']} | {cpu:.1f} | {variable:.2f} | {tok['cpu_s_mb']:.2f} | "
              f"{ratios[0]} | {ratios[1]} |")  # fmt: skip
    print(f"\n(c) in one process: {fixed['cpu_seconds']:.1f} CPU s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=60, help="wiki corpus copies")
    parser.add_argument("--books-scale", type=int, default=10, help="copies of the books")
    parser.add_argument(
        "--mem-scale", type=int, nargs="*", default=[10], help="wiki copies for memory runs"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="also run each job in one process (Beam's in_memory mode, one worker thread): "
        "the job's own CPU without Beam's worker processes and gRPC between them",
    )
    parser.add_argument(
        "--job-checkout",
        help="run the job from another checkout (e.g. an older commit's `git archive`), against "
        "the same corpora and tokenizer baselines: A/B of two versions of the job",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.job_checkout:
            global JOB_PATH
            JOB_PATH = os.path.join(tmp, "job-path")
            os.makedirs(JOB_PATH)  # the checkout's folders are bertforge's sub-packages
            os.symlink(os.path.abspath(args.job_checkout), os.path.join(JOB_PATH, "bertforge"))
        if os.path.isdir(DATA):
            docs = cleaned_documents(((DUMPS, "wiki"), (BOOKS, "books")))
            books, args.vocab = cleaned_documents(((BOOKS, "books"),)), VOCAB
        else:
            print(f"{DATA} not found: synthetic corpora and vocabulary (ratios comparable, "
                  "MB/s not)")  # fmt: skip
            docs, books, args.vocab = synthetic_documents(tmp)
        corpus = os.path.join(tmp, "corpus.jsonl")
        num_bytes = write_corpus(docs, args.scale, corpus)
        books_dir = os.path.join(tmp, "books")
        books_bytes = write_books(books, args.books_scale, books_dir)
        results = [
            measure(f"mixed ({args.scale} copies, {len(docs) * args.scale} documents)", corpus,
                    num_bytes, corpus_sentences(docs), args.scale, args, tmp),
            measure(f"books ({len(books) * args.books_scale} long documents)",
                    f"books:{books_dir}/*.txt", books_bytes, corpus_sentences(books),
                    args.books_scale, args, tmp),
        ]  # fmt: skip
        tiny = os.path.join(tmp, "tiny.jsonl")
        write_corpus(docs[:1], 1, tiny)
        fixed = run_job(tiny, os.path.join(tmp, "out-tiny"), args.workers, args.vocab)
        print_throughput(results, fixed, args.workers)
        if args.in_process:
            out = os.path.join(tmp, "out-tiny-in-process")
            print_in_process(results, run_job(tiny, out, 1, args.vocab, "in_memory"))
        if args.mem_scale:
            print_memory(docs, args, num_bytes, results[0]["job"], tmp)


def print_memory(docs, args, num_bytes: int, job: dict, tmp: str) -> None:
    print("\n| corpus | MB | largest worker RSS MB | runner RSS MB | whole tree RSS MB "
          "| seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    runs = {args.scale: (num_bytes, job)}  # the throughput run's memory is measured too
    for scale in sorted({1, *args.mem_scale} - {args.scale}):
        path = os.path.join(tmp, f"corpus-{scale}.jsonl")
        size = write_corpus(docs, scale, path)
        runs[scale] = size, run_job(path, os.path.join(tmp, f"out-{scale}"), args.workers,
                                    args.vocab)  # fmt: skip
    for scale, (size, result) in sorted(runs.items()):
        print(f"| {scale}x | {size / 1e6:.1f} | {result['max_worker_rss_mb']:.0f} | "
              f"{result['max_runner_rss_mb']:.0f} | {result['max_tree_rss_mb']:.0f} | "
              f"{result['seconds']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
