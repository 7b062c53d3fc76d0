"""Preparation throughput against its bound, the tokenizer, and worker memory as the corpus grows.

On the same cleaned text (the four Wikipedia excerpts and four books of ../shared/data, cleaned by
the job's own readers and written as JSON Lines; replicated to --scale copies, each copy made
distinct by a first sentence so that deduplication keeps it), measure:

(a) the whole `prepare` job (DirectRunner, --workers processes): input MB/s per core;
(b) the tokenizer alone (`encode_batch` on the same sentences, one process): MB/s per core;
and print (a)/(b): the share of the tokenizer's speed the job keeps (target >= 0.6). Also:
(b') the tokenizer with its ids read out (`encoding.ids`, a Python list per sentence): the least
any pipeline must do with `tokenizers`, and a stricter reference for (a);
(c) the job on a one-document corpus: its fixed cost (interpreter, Beam, worker start-up), which
the ratio pays once per run and a large corpus amortizes.
CPU seconds are summed over the job's processes: with other load on the machine they show the
work done, which wall time does not.

Then the peak memory of the job on 1x, each --mem-scale x and the --scale x corpus (RSS sampled
every 0.2 s with psutil): the largest worker process, the runner process (Beam's local runner,
which keeps every PCollection in memory: the part Dataflow's shuffle service plays there), and
the whole tree.

    python benchmarks/prepare_throughput.py [--scale 60] [--mem-scale 10 30] [--workers 2]
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

import _checkout  # noqa: F401  (bertforge, tests.support from this checkout)
import psutil

from bertforge.pipelines.contract.tokenization import load_tokenizer
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


def cleaned_documents() -> list[tuple[str, str]]:
    docs = []
    for names, fmt in ((DUMPS, "wiki"), (BOOKS, "books")):
        for name in names:
            for item in read_file(os.path.join(DATA, name), name, fmt, open_local):
                if isinstance(item, RawDocument):
                    docs.append((item.doc_id, item.text))
    return docs


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


def corpus_sentences(docs: list[tuple[str, str]]) -> list[str]:
    return [s for _, text in docs for s in split_sentences(text)]


def tokenizer_mb_per_s(sentences: list[str], scale: int, read_ids: bool) -> tuple[float, float]:
    """(MB/s, seconds) of `encode_batch` alone over the corpus's sentences, one process."""
    tokenizer = load_tokenizer(VOCAB, lower_case=True)
    num_bytes = sum(len(s.encode("utf-8")) for s in sentences) * scale
    os.environ["RAYON_NUM_THREADS"] = "1"  # per core: the job's workers get one thread each too
    start = time.perf_counter()
    for _ in range(scale):
        for i in range(0, len(sentences), 20_000):  # large batches: the tokenizer at its best
            encodings = tokenizer.encode_batch(sentences[i : i + 20_000], add_special_tokens=False)
            if read_ids:
                for encoding in encodings:
                    encoding.ids  # noqa: B018  (the read is the point)
    seconds = time.perf_counter() - start
    return num_bytes / seconds / 1e6, seconds


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


def run_job(corpus: str, output: str, workers: int) -> dict:
    argv = [
        sys.executable, "-m", "bertforge.pipelines.prepare", f"--input={corpus}",
        f"--output={output}",
        f"--vocab={VOCAB}", "--num_shards=4", "--max_seq_length=128", "--runner=DirectRunner",
        f"--direct_num_workers={workers}", "--direct_running_mode=multi_processing",
    ]  # fmt: skip
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.stop()
    cpu_seconds = sampler.cpu_seconds
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=60, help="corpus copies for throughput")
    parser.add_argument(
        "--mem-scale", type=int, nargs="+", default=[10], help="copies for the memory runs"
    )
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if not os.path.isdir(DATA):
        sys.exit(f"{DATA} not found: this benchmark needs the shared data directory")
    docs = cleaned_documents()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        num_bytes = write_corpus(docs, args.scale, corpus)
        sentences = corpus_sentences(docs)
        tok_mb_s, tok_seconds = tokenizer_mb_per_s(sentences, args.scale, read_ids=False)
        ids_mb_s, ids_seconds = tokenizer_mb_per_s(sentences, args.scale, read_ids=True)
        job = run_job(corpus, os.path.join(tmp, "out"), args.workers)
        tiny = os.path.join(tmp, "tiny.jsonl")
        write_corpus(docs[:1], 1, tiny)
        fixed = run_job(tiny, os.path.join(tmp, "out-tiny"), args.workers)
        job_mb_s = num_bytes / job["seconds"] / args.workers / 1e6
        print(f"\ncorpus: {num_bytes / 1e6:.1f} MB of cleaned text ({args.scale} copies), "
              f"{job['instances']} instances at 128 tokens; load average before: "
              f"{os.getloadavg()[0]:.1f}")  # fmt: skip
        print("| measure | seconds | CPU seconds | MB/s per core | (a) / this |")
        print("|---|---|---|---|---|")
        print(f"| (a) prepare job, {args.workers} workers | {job['seconds']:.1f} | "
              f"{job['cpu_seconds']:.1f} | {job_mb_s:.2f} | |")  # fmt: skip
        print(f"| (b) tokenizer alone, 1 process | {tok_seconds:.1f} | | {tok_mb_s:.2f} | "
              f"**{job_mb_s / tok_mb_s:.2f}** |")  # fmt: skip
        print(f"| (b') tokenizer, ids read out | {ids_seconds:.1f} | | {ids_mb_s:.2f} | "
              f"{job_mb_s / ids_mb_s:.2f} |")  # fmt: skip
        print(f"| (c) job on one document (fixed cost) | {fixed['seconds']:.1f} | "
              f"{fixed['cpu_seconds']:.1f} | | |")  # fmt: skip
        variable_mb_s = num_bytes / (job["seconds"] - fixed["seconds"]) / args.workers / 1e6
        print(f"\nWithout the fixed cost, (a) is {variable_mb_s:.2f} MB/s per core, "
              f"{variable_mb_s / tok_mb_s:.2f} of (b).")  # fmt: skip

        print("\n| corpus | MB | largest worker RSS MB | runner RSS MB | whole tree RSS MB "
              "| seconds |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        runs = {args.scale: (num_bytes, job)}  # the throughput run's memory is measured too
        for scale in sorted({1, *args.mem_scale} - {args.scale}):
            path = os.path.join(tmp, f"corpus-{scale}.jsonl")
            size = write_corpus(docs, scale, path)
            runs[scale] = size, run_job(path, os.path.join(tmp, f"out-{scale}"), args.workers)
        for scale, (size, result) in sorted(runs.items()):
            print(f"| {scale}x | {size / 1e6:.1f} | {result['max_worker_rss_mb']:.0f} | "
                  f"{result['max_runner_rss_mb']:.0f} | {result['max_tree_rss_mb']:.0f} | "
                  f"{result['seconds']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
