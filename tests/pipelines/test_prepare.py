"""The preparation job end to end on Beam's DirectRunner, and its transform under TestPipeline."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.prepare import (
    CreatePretrainingInstances,
    PrepareConfig,
    main,
    pool_of,
    run,
    split_of,
)
from bertforge.pipelines.write import global_order

from .conftest import (
    MAX_SEQ_LENGTH,
    NUM_SHARDS,
    SEED,
    TWO_WORKERS,
    VALIDATION_FRACTION,
    prepare_config,
    write_jsonl,
)


def _table(data_dir: str, rel_path: str) -> pa.Table:
    with pa.memory_map(os.path.join(data_dir, rel_path)) as source:
        return pa.ipc.open_file(source).read_all()  # the IPC *file* format, memory-mapped


def _split_tables(data_dir: str) -> dict[str, list[pa.Table]]:
    found = manifest.read_manifest(data_dir)
    return {
        name: [_table(data_dir, s.path) for s in split.shards]
        for name, split in found.splits.items()
    }


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_manifest_is_complete_and_matches_the_files(prepared, small_vocab):
    data_dir, summary = prepared
    found = manifest.read_manifest(data_dir)
    assert set(found.splits) == {"train", "validation"}
    assert [len(s.shards) for s in found.splits.values()] == [NUM_SHARDS, 2]
    for name, split in found.splits.items():
        for index, shard in enumerate(split.shards):
            assert shard.path == manifest.shard_file_name(name, index, len(split.shards))
            table = _table(data_dir, shard.path)
            assert table.num_rows == shard.num_rows
            assert sum(map(len, table["input_ids"].to_pylist())) == shard.num_tokens
            assert _sha256(os.path.join(data_dir, shard.path)) == shard.sha256
        assert split.num_instances == sum(s.num_rows for s in split.shards) > 0
        assert split.num_tokens == sum(s.num_tokens for s in split.shards)
    assert found.counts["instances"] == sum(s.num_instances for s in found.splits.values())
    assert found.counts["documents"] == sum(s.num_documents for s in found.splits.values())
    assert found.counts["sentences"] > 2 * found.counts["documents"]
    # vocab.txt is a copy of the input vocabulary, and the manifest names its hash.
    assert _sha256(os.path.join(data_dir, manifest.VOCAB_NAME)) == _sha256(small_vocab)
    assert found.tokenizer.vocab_sha256 == _sha256(small_vocab)
    with open(small_vocab, encoding="utf-8") as f:
        assert found.tokenizer.vocab_size == len(f.read().splitlines())
    assert found.tokenizer.lower_case is True
    params = found.instance_params
    assert (params["max_seq_length"], params["seed"], params["dupe_factor"]) == (
        MAX_SEQ_LENGTH,
        SEED,
        2,
    )
    assert params["short_seq_prob"] == 0.1 and params["random_pool_size"] == 40
    assert summary["instances"] == found.counts["instances"]
    metrics = summary["metrics"]  # Beam counters agree with the manifest's own accounting
    assert metrics["instances"] == found.counts["instances"]
    assert metrics["documents"] == found.counts["documents"]
    assert metrics["sentences"] == found.counts["sentences"]
    assert metrics["rejected_invalid_json"] == found.counts["rejected"]["invalid_json"]
    assert (
        summary["splits"]["validation"]["num_instances"] == found.splits["validation"].num_instances
    )
    leftovers = [p for p in Path(data_dir).rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_shards_have_the_design_schema_and_layout(prepared):
    data_dir, _ = prepared
    found = manifest.read_manifest(data_dir)
    expected = pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.uint16()), nullable=False),
            pa.field("num_a_tokens", pa.uint16(), nullable=False),
            pa.field("next_sentence_label", pa.int8(), nullable=False),
            pa.field("doc_id", pa.string(), nullable=False),
        ]
    )
    vocab = {t: i for i, t in enumerate(Path(data_dir, "vocab.txt").read_text().splitlines())}
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    for tables in _split_tables(data_dir).values():
        for table in tables:
            assert table.schema == expected == manifest.shard_schema(found.tokenizer.vocab_size)
            for row in table.to_pylist():
                ids, num_a = row["input_ids"], row["num_a_tokens"]
                assert 5 <= len(ids) <= MAX_SEQ_LENGTH
                assert ids[0] == cls_id and ids[num_a - 1] == sep_id and ids[-1] == sep_id
                assert ids.count(sep_id) == 2 and ids.count(cls_id) == 1
                assert num_a < len(ids) - 1  # B has at least one token


def test_splits_are_disjoint_by_document(prepared):
    data_dir, _ = prepared
    doc_ids = {
        name: {d for table in tables for d in table["doc_id"].to_pylist()}
        for name, tables in _split_tables(data_dir).items()
    }
    assert doc_ids["train"] and doc_ids["validation"]
    assert not doc_ids["train"] & doc_ids["validation"]
    for name, ids in doc_ids.items():
        assert all(split_of(SEED, doc_id, VALIDATION_FRACTION) == name for doc_id in ids)
    found = manifest.read_manifest(data_dir)
    assert found.splits["validation"].num_documents >= len(doc_ids["validation"])


def test_shards_are_balanced_and_shuffled(prepared):
    data_dir, _ = prepared
    for tables in _split_tables(data_dir).values():
        rows = [t.num_rows for t in tables]
        assert max(rows) - min(rows) <= 1
        doc_ids = [d for table in tables for d in table["doc_id"].to_pylist()]
        same_as_previous = sum(a == b for a, b in zip(doc_ids, doc_ids[1:], strict=False))
        assert same_as_previous < 0.1 * len(doc_ids), "rows are in hash order, not document order"
    labels = [
        x for t in _split_tables(data_dir)["train"] for x in t["next_sentence_label"].to_pylist()
    ]
    assert 0.4 < sum(labels) / len(labels) < 0.7


def test_every_format_contributes(prepared):
    data_dir, _ = prepared
    doc_ids = {
        d
        for tables in _split_tables(data_dir).values()
        for t in tables
        for d in t["doc_id"].to_pylist()
    }
    assert any(d.startswith("books.txt:") for d in doc_ids)
    # A record's own id, within its file (readers._record_id).
    assert any(d.startswith("compressed.jsonl.gz:gz:") for d in doc_ids)
    assert any(d.startswith("docstrings.jsonl:stdlib:") for d in doc_ids)


def test_rejects_are_written_and_counted(prepared):
    data_dir, _ = prepared
    found = manifest.read_manifest(data_dir)
    with open(os.path.join(data_dir, manifest.REJECTS_NAME), encoding="utf-8") as f:
        rejects = [json.loads(line) for line in f]
    rejected = found.counts["rejected"]
    assert len(rejects) == sum(rejected.values())
    for reason in (
        "invalid_json",
        "too_few_sentences",
        "duplicate_document",
        "duplicate_doc_id",
        "empty_document",
    ):
        assert rejected.get(reason, 0) >= 1, reason
    by_id = {r["doc_id"]: r for r in rejects}
    # the smallest doc_id is kept
    assert by_id["extra.jsonl:zzz:copy"]["reason"] == "duplicate_document"
    assert by_id["extra.jsonl:one-sentence"]["reason"] == "too_few_sentences"
    assert by_id["extra.jsonl:collide"]["reason"] == "duplicate_doc_id"  # within one file
    assert rejects == sorted(
        rejects, key=lambda r: (r["reason"], r["source"], r["doc_id"], r["detail"])
    )
    assert found.counts["input_records"] == found.counts["documents"] + sum(rejected.values())


def test_two_files_numbering_their_records_alike_both_count(tmp_path, small_vocab,
                                                              docstring_corpus):
    """Two JSON Lines files whose `id`s both start at 0 (per-file numbering, two dumps' page
    ids): one file's documents were all rejected as duplicate_doc_id, and the job said 0."""
    with open(docstring_corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:40]
    for name, part in (("a.jsonl", texts[:20]), ("b.jsonl", texts[20:])):
        write_jsonl(tmp_path / name, [{"id": i, "text": text} for i, text in enumerate(part)])
    run(prepare_config([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                       str(tmp_path / "out"), small_vocab))
    counts = manifest.read_manifest(str(tmp_path / "out")).counts
    assert counts["rejected"].get("duplicate_doc_id", 0) == 0
    assert counts["input_records"] == 40


def test_no_usable_document_is_a_clear_error(tmp_path, small_vocab):
    corpus = tmp_path / "bad.jsonl"
    write_jsonl(corpus, ["not json", {"text": "Only one sentence here."}])
    output = tmp_path / "out"
    with pytest.raises(ValueError, match="no usable document remains"):
        run(prepare_config([str(corpus)], str(output), small_vocab))
    assert not (output / manifest.MANIFEST_NAME).exists()


def test_a_corpus_that_makes_no_training_instance_is_a_clear_error(tmp_path, small_vocab):
    """20,000 words without a sentence end: one 'sentence' far past --max-seq-length, so no
    pair. The job exited 0 with an empty training split and a warning that NSP learns a
    constant label from pairs that did not exist."""
    rng = random.Random(1)
    corpus = tmp_path / "unpunctuated.txt"
    corpus.write_text(" ".join(rng.choice(["the", "cat", "sat"]) for _ in range(20_000)))
    with pytest.raises(ValueError, match="no training instance was made: the 1 document"):
        run(prepare_config([str(corpus)], str(tmp_path / "out"), small_vocab))
    assert not (tmp_path / "out" / manifest.MANIFEST_NAME).exists()


def test_missing_inputs_are_a_clear_error(tmp_path, small_vocab):
    pattern = str(tmp_path / "nowhere-*.jsonl")
    with pytest.raises(ValueError, match="nowhere-"):
        run(prepare_config([pattern], str(tmp_path / "out"), small_vocab))
    with pytest.raises(ValueError, match="max_seq_length must be at least 5"):
        main([f"--input={pattern}", f"--output={tmp_path}", f"--vocab={small_vocab}",
              "--max_seq_length=4"])
    # Past the shards' uint16 num_a_tokens: an OverflowError after all the tokenizing.
    with pytest.raises(ValueError, match="max_seq_length must be at most 65,535"):
        main([f"--input={pattern}", f"--output={tmp_path}", f"--vocab={small_vocab}",
              "--max_seq_length=200000"])
    with pytest.raises(ValueError, match="inputs are required"):
        main([f"--output={tmp_path}", f"--vocab={small_vocab}"])
    # The folder `bertforge vocab` wrote into, given as --vocab: "[Errno 21] Is a directory".
    with pytest.raises(ValueError, match=f"a directory, not a file \\(the vocabulary in it: "
                                         f"{tmp_path}/vocab.txt\\)"):
        main([f"--input={small_vocab}", f"--output={tmp_path / 'out'}", f"--vocab={tmp_path}"])
    # Beam lists it as a runner; its manifest lost the per-file records on alternate runs.
    with pytest.raises(ValueError, match="--runner BundleBasedDirectRunner: Beam's older local"):
        main([f"--input={pattern}", f"--output={tmp_path}", f"--vocab={small_vocab}",
              "--runner=BundleBasedDirectRunner"])



def test_a_local_dry_run_leaves_nothing_in_the_temporary_directory(tmp_path, corpus_files,
                                                                   small_vocab, monkeypatch):
    """Beam's Pipeline makes a `beam-pipeline-temp*` folder that only its run removes: every
    dry run, which never runs, left one in TMPDIR."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    argv = [f"--input={entry}" for entry in corpus_files]
    report = main(argv + [f"--output={tmp_path / 'out'}", f"--vocab={small_vocab}",
                          "--runner=DirectRunner", "--dry_run=True"])
    assert report["dry_run"] is True
    assert os.listdir(temporary) == []
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shards_are_byte_identical_across_workers_and_runs(
    prepared, corpus_files, small_vocab, tmp_path
):
    data_dir, _ = prepared

    def files(root: str) -> dict[str, bytes]:
        return {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(Path(root).rglob("*"))
            if p.is_file()
        }

    expected = files(data_dir)
    assert len([p for p in expected if p.endswith(".arrow")]) == NUM_SHARDS + 2
    two_workers = str(tmp_path / "two")
    run(prepare_config(corpus_files, two_workers, small_vocab), TWO_WORKERS)
    assert files(two_workers) == expected
    again = str(tmp_path / "again")
    run(prepare_config(corpus_files, again, small_vocab))
    assert files(again) == expected


# ------------------------------------------------------------------ the transform, token provenance

NUM_SYNTHETIC_DOCS = 120
WORD_OFFSET = 6  # [PAD] [UNK] [CLS] [SEP] [MASK] . then w0, w1, ...


def _synthetic_vocab() -> bytes:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + [
        f"w{i}" for i in range(NUM_SYNTHETIC_DOCS)
    ]
    return "".join(t + "\n" for t in tokens).encode()


def _synthetic_documents():
    """Document n repeats the word `wn`: every token says which document it came from."""
    from bertforge.pipelines.read.records import RawDocument

    rng = random.Random(0)
    docs = []
    for n in range(NUM_SYNTHETIC_DOCS):
        # Capitalized, so blingfire sees sentence starts; lower-casing maps W7 to w7.
        sentences = [
            " ".join([f"W{n}"] + [f"w{n}"] * rng.randint(1, 11)) + "."
            for _ in range(rng.randint(3, 20))
        ]
        docs.append(RawDocument(f"doc{n:03d}", f"synthetic:{n}", text=" ".join(sentences)))
    return docs


def _check_provenance(config: PrepareConfig, docs):
    num_docs = {}
    for doc in docs:
        split = split_of(config.seed, doc.doc_id, config.validation_fraction)
        num_docs[split] = num_docs.get(split, 0) + 1

    def place(doc_id: str) -> tuple[str, int]:
        split = split_of(config.seed, doc_id, config.validation_fraction)
        return split, pool_of(config.seed, doc_id, num_docs[split], config.random_pool_size)

    def check(batches):
        assert sum(len(batch) for batch in batches) > 100
        labels = {split: set() for split in num_docs}
        for batch in batches:
            offsets = batch.offsets()
            for row, doc_id in enumerate(batch.doc_ids):
                ids = batch.ids[offsets[row] : offsets[row + 1]].tolist()
                num_a, label = int(batch.num_a[row]), int(batch.labels[row])
                assert place(doc_id)[0] == batch.split
                words_a = {t for t in ids[1 : num_a - 1] if t >= WORD_OFFSET}
                words_b = {t for t in ids[num_a:-1] if t >= WORD_OFFSET}
                assert words_a == {WORD_OFFSET + int(doc_id[3:])}
                assert len(words_b) == 1
                b_doc = f"doc{words_b.pop() - WORD_OFFSET:03d}"
                if label == 0:
                    assert b_doc == doc_id
                else:
                    assert b_doc != doc_id, "random B from the same document"
                    assert place(b_doc) == place(doc_id), "random B from the same split and pool"
                labels[batch.split].add(label)
        assert labels == {split: {0, 1} for split in num_docs}

    return check


def test_create_pretraining_instances_provenance():
    config = PrepareConfig(
        inputs=("unused",),
        output="unused",
        vocab="unused",
        max_seq_length=32,
        validation_fraction=0.25,
        random_pool_size=30,  # ~90 train documents: 3 pools
        seed=SEED,
    )
    docs = _synthetic_documents()
    # The FnApiRunner: Beam's DirectRunner first tries Prism, whose failed start offline left a
    # beam-temp* folder and two others in TMPDIR each time.
    with BeamTestPipeline(runner=FnApiRunner(), options=PipelineOptions([])) as pipeline:
        created = (
            pipeline | beam.Create(docs) | CreatePretrainingInstances(config, _synthetic_vocab())
        )
        assert_that(created["instances"], _check_provenance(config, docs),
                    label="CheckProvenance")
        assert_that(created["rejects"], equal_to([]), label="CheckNoRejects")
        totals = created["document_stats"] | "TotalDocs" >> beam.Map(
            lambda d: sum(v[0] for v in d.values())
        )
        assert_that(totals, equal_to([NUM_SYNTHETIC_DOCS]), label="CheckDocumentCount")


def test_shards_written_in_pieces_equal_shards_written_whole(
    monkeypatch, corpus_files, small_vocab, tmp_path
):
    """Many pieces per shard (tiny batches, so the small corpus spans several) change no byte."""
    monkeypatch.setattr(global_order, "ROWS_PER_BATCH", 4)

    def shard_bytes(root: str) -> dict[str, bytes]:
        found = {p.name: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}
        assert not [name for name in found if ".tmp" in name]  # every piece file was removed
        return found

    whole, pieces = str(tmp_path / "whole"), str(tmp_path / "pieces")
    run(prepare_config(corpus_files, whole, small_vocab, rows_per_piece=1_000_000))
    run(prepare_config(corpus_files, pieces, small_vocab, rows_per_piece=8))
    assert shard_bytes(pieces) == shard_bytes(whole)
    num_rows = manifest.read_manifest(pieces).splits["train"].shards[0].num_rows
    assert num_rows > 3 * 8  # so each train shard really had several pieces


def test_pools_are_bounded_by_documents_and_by_text():
    from bertforge.pipelines.instances.pairs_transform import num_pools

    assert num_pools(100, 512) == 1
    assert num_pools(1_000, 512) == 2
    # 5,000 articles of 100 kB: few documents a pool by count, but 125 pools of ~4 MB, not
    # 10 pools of 50 MB.
    assert num_pools(5_000, 512, 500_000_000, 4_000_000) == 125
    # 500 books of 1 MB: 31 pools of 16 books, not 125 of 4 (where e^-4, 1.8 % of the books,
    # would be alone in their pool with no other to draw a random B from), nor one of 500 MB.
    assert num_pools(500, 512, 500_000_000, 4_000_000) == 31
    assert num_pools(20, 512, 20_000_000, 4_000_000) == 1
    assert num_pools(0, 512, 0, 4_000_000) == 1
