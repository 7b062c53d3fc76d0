"""Fixtures shared by the pipelines tests: a small real corpus and a vocabulary trained on it."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus  # the demo's corpus
from bertforge.pipelines.instances.sentences import split_sentences
from bertforge.pipelines.prepare import run
from bertforge.pipelines.prepare_options import PrepareConfig
from bertforge.pipelines.vocab import train_wordpiece_vocab
from bertforge.pipelines.vocab_options import VocabConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# The team's shared, read-only data (real corpora, GLUE, vocabularies) lives beside the
# repository; the tests that need it are skipped without it.
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# 150 kB of docstrings: ~150 documents, parsed in well under a second.
SMALL_CORPUS_BYTES = 150_000
# Parameters of the prepared test dataset.
SEED = 7
VALIDATION_FRACTION = 0.15
MAX_SEQ_LENGTH = 64
NUM_SHARDS = 3


def shared_data_file(name: str) -> Path:
    """A file from ../shared/data, or a skip that says why."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} not found: the shared data directory (../shared/data) is absent")
    return path


@pytest.fixture(scope="session")
def docstring_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docstrings.jsonl"
    write_docstring_corpus(str(path), target_bytes=SMALL_CORPUS_BYTES)
    return str(path)


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory: pytest.TempPathFactory, docstring_corpus: str) -> str:
    """A lower-cased 3,000-piece vocabulary trained on the small corpus."""
    out = tmp_path_factory.mktemp("vocab")
    return train_wordpiece_vocab(VocabConfig((docstring_corpus,), str(out), vocab_size=3000))


def write_jsonl(path: Path, records: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")


@pytest.fixture(scope="session")
def corpus_files(tmp_path_factory, docstring_corpus) -> list[str]:
    """The docstring corpus plus records that exercise every format and every reject reason."""
    root = tmp_path_factory.mktemp("inputs")
    with open(docstring_corpus, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    shutil.copy(docstring_corpus, root / "docstrings.jsonl")
    multi = [d for d in docs if len(split_sentences(d["text"])) >= 4]
    write_jsonl(
        root / "extra.jsonl",
        [
            {"doc_id": "zzz:copy", "text": multi[0]["text"]},  # duplicate of a docstring document
            "{this line is not json",
            {"doc_id": "one-sentence", "text": "A single sentence cannot make a pair."},
            {"doc_id": "collide", "text": "Two records claim this id. This is the first of them."},
            {"doc_id": "collide", "text": "Two records claim this id. This is the second of them."},
            {"text": "   "},
        ],
    )
    # Real sentences in a new order, so that they are not duplicates of the documents above.
    with open(root / "books.txt", "w", encoding="utf-8") as f:  # Google's format
        for doc in multi[1:9]:
            f.write("\n".join(reversed(split_sentences(doc["text"]))) + "\n\n")
    with gzip.open(root / "compressed.jsonl.gz", "wt", encoding="utf-8") as f:
        for doc in multi[9:13]:
            sentences = split_sentences(doc["text"])
            text = " ".join(sentences[1:] + sentences[:1])
            f.write(json.dumps({"doc_id": "gz:" + doc["doc_id"], "text": text}) + "\n")
    return [str(root / "*.jsonl"), str(root / "books.txt") + "," + str(root / "*.gz")]


def prepare_config(inputs: list[str], output: str, vocab: str, **overrides) -> PrepareConfig:
    """The test dataset's parameters; keywords override fields."""
    return PrepareConfig(**{
        # The command line's comma-separated lists are its own (see test_config_fields).
        "inputs": tuple(p for entry in inputs for p in entry.split(",")), "output": output,
        "vocab": vocab, "seed": SEED,
        "validation_fraction": VALIDATION_FRACTION, "max_seq_length": MAX_SEQ_LENGTH,
        "num_shards": NUM_SHARDS, "num_validation_shards": 2, "random_pool_size": 40,
        "dupe_factor": 2, **overrides,
    })


# Two Beam worker processes, as a local run on a real machine uses.
TWO_WORKERS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_files, small_vocab):
    output = str(tmp_path_factory.mktemp("dataset") / "data")
    summary = run(prepare_config(corpus_files, output, small_vocab))
    return output, summary
