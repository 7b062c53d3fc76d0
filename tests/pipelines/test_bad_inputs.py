"""The job on a directory of bad files plus one good one: it completes and counts every reject."""

from __future__ import annotations

import bz2
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.prepare import main, run

from .conftest import prepare_config, write_jsonl

# 50 MB would take ~10 s of sentence splitting alone; 6 MB shows the same bound in a test.
LONG_LINE_BYTES = 6_000_000


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory, docstring_corpus):
    root = tmp_path_factory.mktemp("bad")
    with open(docstring_corpus, encoding="utf-8") as f:
        good = [json.loads(line) for line in f][:60]
    write_jsonl(root / "good.jsonl", good)
    (root / "empty.jsonl").write_bytes(b"")
    (root / "binary.txt").write_bytes(os.urandom(4096))
    page = (
        "<page><title>{0}</title><ns>0</ns><id>{0}</id>"
        "<revision><text>{1}</text></revision></page>\n"
    )
    xml = (
        "<mediawiki>\n"
        + page.format(1, "Good page. It has two sentences.")
        + "<page><title>cut</title><ns>0</ns><id>2</id><revision><text>cut mid\n"
        + page.format(3, "")
        + page.format(4, "Another page. With text.")
        + "</mediawiki>\n"
    )
    (root / "dump.xml").write_text(xml, encoding="utf-8")
    (root / "cut.xml.bz2").write_bytes(bz2.compress(xml.encode())[:-60])
    (root / "latin1.txt").write_bytes("Caf\xe9 one.\nCaf\xe9 two.\n".encode("latin-1"))
    long_line = ("word " * (LONG_LINE_BYTES // 5)).encode() + b"\n"
    (root / "long.txt").write_bytes(b"Start here.\n" + long_line)
    return root


def test_bad_inputs_complete_and_are_counted(bad_dir, small_vocab, tmp_path):
    output = str(tmp_path / "out")
    summary = run(prepare_config([str(bad_dir)], output, small_vocab))
    found = manifest.read_manifest(output)
    rejected, repaired = found.counts["rejected"], found.counts["repaired"]
    for reason in ("empty_file", "binary_file", "malformed_xml", "empty_page"):
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    assert rejected["truncated_compressed_file"] == 1
    assert repaired == {"invalid_utf8": 1, "overlong_sentence": 1}
    with open(os.path.join(output, manifest.REJECTS_NAME), encoding="utf-8") as f:
        listed = [json.loads(line)["reason"] for line in f]
    assert len(listed) == sum(rejected.values()) + sum(repaired.values())
    assert found.counts["input_records"] == found.counts["documents"] + sum(rejected.values())
    assert summary["metrics"]["rejected_binary_file"] == 1
    assert summary["metrics"]["repaired_overlong_sentence"] == 1
    assert found.counts["instances"] > 0


def test_unknown_flags_and_missing_paths_are_one_clear_line(tmp_path, small_vocab):
    good = tmp_path / "g.jsonl"
    write_jsonl(good, [{"text": "One. Two."}])
    with pytest.raises(ValueError, match=r"unknown flag\(s\) --bogus"):
        main([f"--input={good}", f"--output={tmp_path / 'o'}", f"--vocab={small_vocab}",
              "--bogus=1"])
    with pytest.raises(ValueError, match="must not set the job's own options"):
        run(prepare_config([str(good)], str(tmp_path / "o"), small_vocab), ["--num_shards=2"])
    with pytest.raises(ValueError, match="matches no file$"):
        run(prepare_config([str(tmp_path / "missing.xml")], str(tmp_path / "o"), small_vocab))
    # A misspelt format prefix was the same "matches no file", the file being right there.
    with pytest.raises(ValueError, match=r"matches no file \('book:' is no format; the formats "
                       r"are books, jsonl, "):
        run(prepare_config([f"book:{good}"], str(tmp_path / "o"), small_vocab))
    # A real format's prefix on a path that matches nothing: the path is what is wrong.
    with pytest.raises(ValueError, match="'books:.*missing/\\*.txt' matches no file$"):
        run(prepare_config([f"books:{tmp_path}/missing/*.txt"], str(tmp_path / "o"), small_vocab))
    with pytest.raises(ValueError, match="cannot read"):
        run(prepare_config([str(good)], str(tmp_path / "o"), str(tmp_path / "no-vocab.txt")))


def test_a_vocabulary_with_a_repeated_token_is_refused_before_the_output_is_touched(
        tmp_path, small_vocab):
    """A token appended to a vocabulary that already holds it (domain words added to Google's)
    took the id the job's sentence marker gets, so every occurrence of the word vanished from
    the shards, without a word."""
    good = tmp_path / "g.jsonl"
    write_jsonl(good, [{"text": "The cat sat. The dog ran."}])
    lines = open(small_vocab, encoding="utf-8").read().splitlines()
    repeated = tmp_path / "vocab.txt"
    repeated.write_text("\n".join([*lines, "the"]) + "\n", encoding="utf-8")
    first_the = lines.index("the") + 1
    earlier = tmp_path / "o" / manifest.MANIFEST_NAME
    earlier.parent.mkdir()
    earlier.write_text("{}")
    with pytest.raises(ValueError, match=rf"repeats 'the' \(lines {first_the} and "
                                         rf"{len(lines) + 1}\)"):
        run(prepare_config([str(good)], str(tmp_path / "o"), str(repeated)))
    assert earlier.read_text() == "{}"
    # A model's vocabulary from elsewhere (fine-tuning a Hugging Face BERT) is read as
    # transformers reads it: the last of the repeats gives the token its id.
    from bertforge.pipelines.contract.tokenization import read_vocab

    assert read_vocab(str(repeated), allow_repeats=True)["the"] == len(lines)


def test_a_vocabulary_whose_pad_is_not_its_first_line_is_refused_before_the_job(
        tmp_path, small_vocab):
    """The `tokenizers` quickstart's order ([UNK], [CLS], [SEP], [PAD], [MASK]) was prepared
    and trained: the model pads with id 0, whose embedding never trains, so [UNK] never did,
    and the export named [UNK]'s id as its pad_token_id."""
    good = tmp_path / "g.jsonl"
    write_jsonl(good, [{"text": "The cat sat. The dog ran."}])
    lines = [line for line in open(small_vocab, encoding="utf-8").read().splitlines()
             if line != "[PAD]"]
    moved = tmp_path / "vocab.txt"
    moved.write_text("\n".join([*lines[:3], "[PAD]", *lines[3:]]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{moved} has \[PAD\] on line 4: BERT pads with id 0"
                                         rf".*line 1 holds {re.escape(repr(lines[0]))}\); move it "
                                         "there"):
        run(prepare_config([str(good)], str(tmp_path / "o"), str(moved)))
    assert not (tmp_path / "o" / manifest.MANIFEST_NAME).exists()
    # A model's own vocabulary (fine-tuning a Hugging Face BERT) is read as it is.
    from bertforge.pipelines.contract.tokenization import read_vocab

    assert read_vocab(str(moved), allow_repeats=True)["[PAD]"] == 3


def test_a_file_that_is_no_vocabulary_is_said_to_be_none(tmp_path):
    """A corpus named as --vocab gave an 8.8 KB line of repeated blank lines' numbers, and a
    compressed file a decoder's error that named no file."""
    import bz2

    from bertforge.pipelines.contract.tokenization import parse_vocab, read_vocab

    prose = tmp_path / "hamlet.txt"
    prose.write_text("ACT I\n\nScene 1\n\nEnter Bernardo\n\n" * 500, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{prose} lacks the BERT special tokens \['\[PAD\]'"):
        read_vocab(str(prose))
    packed = tmp_path / "vocab.txt.bz2"
    packed.write_bytes(bz2.compress(b"[PAD]\n" * 100))
    with pytest.raises(ValueError, match=rf"^{packed} is not UTF-8 text \(.*\): not a vocab"):
        read_vocab(str(packed))
    specials = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"
    with pytest.raises(ValueError, match=r"repeats '' \(lines 6, 7, 8 and 497 more\)"):
        parse_vocab((specials + "\n" * 500 + "the\n").encode())


def test_nothing_usable_is_an_error(tmp_path, small_vocab):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_bytes(b"")
    (tmp_path / "in" / "bin.txt").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="no usable document remains"):
        run(prepare_config([str(tmp_path / "in")], str(tmp_path / "out"), small_vocab))


def test_a_directory_stands_for_every_file_under_it(tmp_path, monkeypatch):
    """WikiExtractor's layout (AA/wiki_00, AB/wiki_00): the files in subdirectories are corpus
    too; a hidden subdirectory (.git) is not, a hidden file is (as before)."""
    from bertforge.pipelines.read.inputs_transform import match_inputs

    for name in ("AA/wiki_00", "AB/wiki_00", "top.txt", ".hidden.txt", ".git/objects/x"):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text("One. Two.\n")
    (tmp_path / "only-hidden" / ".cache").mkdir(parents=True)
    (tmp_path / "only-hidden" / ".cache" / "a.txt").write_text("One. Two.\n")
    with pytest.raises(ValueError, match="matches no file \\(its hidden folders, such as .git, "
                                         "are never read"):
        match_inputs((str(tmp_path / "only-hidden"),))
    assert match_inputs(("books:" + str(tmp_path / "in"),)) == [
        (str(tmp_path / "in" / name), "books")
        for name in (".hidden.txt", "AA/wiki_00", "AB/wiki_00", "top.txt")]
    # A file named twice, spelled two ways, is read once, as the later naming says.
    monkeypatch.chdir(tmp_path)
    assert match_inputs(("in/AA", "books:./in/AA/wiki_00", str(tmp_path / "in/AA/wiki_00"))) \
        == [("in/AA/wiki_00", None)]
    assert match_inputs(("in/AA", "books:./in/AA/wiki_00")) == [("in/AA/wiki_00", "books")]
    # Two formats forced on one file: the last one won, without a word.
    with pytest.raises(ValueError, match=r"^in/AA/wiki_00 is named as books \('books:in'\) "
                       r"and as sentences \('sentences:./in/AA/wiki_00'\): give it one "
                       r"format$"):
        match_inputs(("books:in", "sentences:./in/AA/wiki_00"))
    assert match_inputs(("books:in/AA", "books:./in/AA/wiki_00")) == [("in/AA/wiki_00", "books")]


def test_object_storage_out_of_reach_is_one_line_naming_the_input():
    """Beam's traceback before (123 lines for gs:// after the client's 99 s of retries); here
    s3://, which this installation cannot reach at once (no AWS client set up)."""
    from bertforge.pipelines.read.inputs_transform import match_inputs

    with pytest.raises(ValueError, match=r"^--input 'books:s3://a-bucket/x\.txt': cannot reach "
                       r"it \(.+\); check the path, the credentials and the network$"):
        match_inputs(("books:s3://a-bucket/x.txt",))


def test_a_dangling_symbolic_link_among_the_inputs_is_named(tmp_path, small_vocab):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "good.jsonl", [{"text": "One. Two."}])
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "in" / "moved.jsonl")
    expected = f"{tmp_path / 'in' / 'moved.jsonl'} is a symbolic link to a missing file"
    for pattern in (str(tmp_path / "in"), str(tmp_path / "in" / "*.jsonl")):
        with pytest.raises(ValueError, match=expected):
            run(prepare_config([pattern], str(tmp_path / "out"), small_vocab))
    assert not (tmp_path / "out").exists()


def _as_an_unprivileged_user(code: str) -> subprocess.CompletedProcess:
    """`code` in a Python that permissions bind: as root, through `unshare -U` (uid nobody)."""
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None or subprocess.run(
                ["unshare", "-U", "true"], capture_output=True).returncode != 0:
            pytest.skip("running as root, and `unshare -U` is unavailable to drop privileges")
        command = ["unshare", "-U", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_what_cannot_be_read_is_named_before_the_job(tmp_path, symlinks_and_modes):
    """An unreadable file failed the job in a Beam worker with a traceback (again on every
    rerun); an unreadable folder under an --input folder, or one a glob names, was left out
    or 'matched no file'; a linked folder was left out without a word."""
    corpus = symlinks_and_modes
    (corpus / "elsewhere").mkdir()
    os.symlink(corpus / "elsewhere", corpus / "in" / "linked")
    patterns = [str(corpus / "in"), str(corpus / "secret.txt"), str(corpus / "locked" / "*.txt")]
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from bertforge.pipelines.read.inputs_transform import match_inputs\n"
            f"for pattern in {patterns!r}:\n"
            "    try: match_inputs((pattern,))\n"
            "    except ValueError as error: print(error)\n")
    out = _as_an_unprivileged_user(code).stdout
    assert f"cannot read its folder {corpus / 'in' / 'locked'} (Permission denied)" in out
    assert f"cannot read {corpus / 'secret.txt'} (permission denied)" in out
    assert f"--input '{corpus / 'locked' / '*.txt'}': cannot read its folder " \
           f"{corpus / 'locked'} (permission denied)" in out
    os.chmod(corpus / "in" / "locked", 0o755)
    out = _as_an_unprivileged_user(code).stdout
    assert f"leaving out {corpus / 'in' / 'linked'}: a symbolic link to a folder" in out


def test_an_output_that_cannot_be_written_is_named_before_the_vocabulary_is_trained(
        symlinks_and_modes):
    """`bertforge vocab` into a read-only folder trained first (minutes on a large corpus),
    then failed writing vocab.txt.tmp."""
    corpus = symlinks_and_modes
    os.chmod(corpus / "locked", 0o555)  # listable, not writable
    code = ("from bertforge.cluster.cli import main\n"
            f"main(['vocab', '--input', {str(corpus / 'in' / 'a.txt')!r}, "
            f"'--output', {str(corpus / 'locked' / 'v')!r}])\n")
    done = _as_an_unprivileged_user(code)
    assert (f"--output {corpus / 'locked' / 'v'}: {corpus / 'locked'} is not writable "
            "(permission denied)") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def symlinks_and_modes():
    """A corpus folder others may enter (pytest's tmp_path is its owner's alone): a readable
    file in `in/`, a locked folder inside it and beside it, an unreadable file."""
    corpus = Path(tempfile.mkdtemp(prefix="bertforge-modes-"))
    os.chmod(corpus, 0o755)
    for folder in ("in", "in/locked", "locked"):
        (corpus / folder).mkdir()
        (corpus / folder / "a.txt").write_text("One sentence. Two sentences.\n")
    (corpus / "secret.txt").write_text("One sentence. Two sentences.\n")
    for path in ("in/locked", "locked", "secret.txt"):
        os.chmod(corpus / path, 0)
    yield corpus
    for path in ("in/locked", "locked", "secret.txt"):
        os.chmod(corpus / path, 0o755)
    shutil.rmtree(corpus)


def test_a_dataset_that_cannot_teach_nsp_or_be_evaluated_is_warned_of(tmp_path, small_vocab,
                                                                      caplog):
    """One book: every pair a real next (NSP learned a constant label) and no validation
    split, found only by `eval`. Two documents: no word of either."""
    text = " ".join(f"Sentence number {i} is here." for i in range(400))
    one = tmp_path / "one.jsonl"
    write_jsonl(one, [{"text": text}])
    with caplog.at_level("WARNING", logger="bertforge"):
        run(prepare_config([str(one)], str(tmp_path / "o1"), small_vocab))
    said = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(m.startswith("the training split holds 1 document: next-sentence prediction "
                            "draws its random second segment from another") for m in said), said
    assert any(m.startswith("the validation split is empty") for m in said), said
    caplog.clear()
    many = tmp_path / "many.jsonl"
    write_jsonl(many, [{"text": f"Document {d} begins. " + text} for d in range(60)])
    with caplog.at_level("WARNING", logger="bertforge"):
        run(prepare_config([str(many)], str(tmp_path / "o2"), small_vocab))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    caplog.clear()  # no validation split asked for: none missed
    with caplog.at_level("WARNING", logger="bertforge"):
        run(prepare_config([str(many)], str(tmp_path / "o3"), small_vocab,
                           validation_fraction=0.0, num_validation_shards=0))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_vocabulary_that_does_not_fit_the_corpus_is_warned_of(tmp_path, caplog):
    """A vocabulary of other text (here: the special tokens and 'the') made a dataset of
    [UNK]s that `inspect --verify` passed and that trained without a word."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n.\n")
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"text": f"The document {d} begins. The cat sat on the mat. It slept."}
                         for d in range(60)])
    with caplog.at_level("WARNING", logger="bertforge"):
        summary = run(prepare_config([str(corpus)], str(tmp_path / "out"), str(vocab)))
    unknown = summary["metrics"]["unknown_pieces"] / summary["metrics"]["tokenized_pieces"]
    assert unknown > 0.5
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"{100 * unknown:.1f} % of the corpus's word pieces are [UNK]: "
                            f"the vocabulary {vocab} does not fit this text") for m in said), said
    # `inspect` shows the share too ([CLS] and [SEP] among the tokens).
    from bertforge.pipelines.dataset_stats import format_report, inspect_dataset

    stats = inspect_dataset(str(tmp_path / "out"), num_samples=0)
    share = stats["splits"]["train"]["unknown_share"]
    assert 0.5 < share < unknown
    assert f"  [UNK]: {100 * share:.2f} % of the tokens" in format_report(stats)


def test_pairs_mostly_random_for_sequences_too_short_are_warned_of(tmp_path, small_vocab,
                                                                   caplog):
    """At 16 tokens a sentence fills a sequence alone, with no real next to pair: NSP labels
    were nearly all "random" without a word (`inspect` showed it)."""
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"text": f"Document {d} begins here today. The cat sat on the mat all "
                                  "day long. It slept until the evening came."}
                         for d in range(60)])
    with caplog.at_level("WARNING", logger="bertforge"):
        summary = run(prepare_config([str(corpus)], str(tmp_path / "out"), small_vocab,
                                     max_seq_length=16))
    metrics = summary["metrics"]
    share = metrics["random_next"] / metrics["instances"]
    from bertforge.pipelines.dataset_stats import inspect_dataset

    splits = inspect_dataset(str(tmp_path / "out"), num_samples=0)["splits"].values()
    assert metrics["random_next"] == sum(split["nsp"]["random_next"] for split in splits)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"{100 * share:.0f} % of the sentence pairs have a random next "
                            "sentence (half would be the design): at --max-seq-length 16")
               for m in said), said


def test_shards_left_empty_are_warned_of_with_the_flag_that_sets_them(tmp_path, small_vocab,
                                                                       caplog):
    """More validation shards asked for than the split has instances: the rest are written
    empty, and the warning says how many and which flag sets them."""
    text = " ".join(f"Sentence number {i} is here." for i in range(12))
    corpus = tmp_path / "docs.jsonl"
    write_jsonl(corpus, [{"text": f"Document {d} begins. " + text} for d in range(20)])
    with caplog.at_level("WARNING", logger="bertforge"):
        summary = run(prepare_config([str(corpus)], str(tmp_path / "out"), small_vocab,
                                     num_validation_shards=40))
    validation = summary["splits"]["validation"]
    assert 0 < validation["num_instances"] < 40 == validation["num_shards"]
    empty = 40 - validation["num_instances"]
    assert validation["num_empty_shards"] == empty
    assert summary["splits"]["train"]["num_empty_shards"] == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"{empty} of the validation split's 40 shards are empty: it has "
                    f"{validation['num_instances']} instances; --num-validation-shards sets "
                    "how many shards"], said


def test_a_length_past_berts_positions_is_warned_of_before_the_job(tmp_path, small_vocab,
                                                                   caplog):
    """`train` refuses a dataset longer than its model's positions (512 in every preset and
    published checkpoint); prepare says so first, naming what would train on it."""
    corpus = tmp_path / "docs.jsonl"
    write_jsonl(corpus, [{"text": f"Document {d} begins. Then it ends."} for d in range(4)])
    with caplog.at_level("WARNING", logger="bertforge"):
        run(prepare_config([str(corpus)], str(tmp_path / "out"), small_vocab,
                           max_seq_length=1024))
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert ("--max-seq-length 1024 is past the 512 positions of BERT's presets and published "
            "checkpoints: training on this dataset needs a model with max_position_embeddings "
            ">= 1024, which no preset has (a BertConfig field of the model's)") in said, said


def test_bertforge_outputs_inside_the_corpus_folder_are_not_read_as_corpus(tmp_path,
                                                                           small_vocab):
    """`prepare --input corpus` read what bertforge had written under corpus/ as text: the
    --vocab file, a `vocab` output's vocab.txt and log, an earlier dataset's shards, manifest
    and vocabulary, a run's logs. Only the corpus is read; a user's own folders named `logs`
    or files named vocab.txt elsewhere still are."""
    import shutil

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = " ".join(f"Sentence number {i} is here." for i in range(12))
    write_jsonl(corpus / "docs.jsonl", [{"text": f"Document {d} begins. " + text}
                                        for d in range(8)])
    shutil.copy(small_vocab, corpus / "my-vocab.txt")  # the --vocab, kept beside the corpus
    (corpus / "vocab" / "logs").mkdir(parents=True)  # what `bertforge vocab` leaves
    shutil.copy(small_vocab, corpus / "vocab" / "vocab.txt")
    (corpus / "vocab" / "logs" / "vocab.log").write_text("vocab: 120 tokens\n")
    (corpus / "run" / "logs").mkdir(parents=True)  # a run's logs
    (corpus / "run" / "logs" / "train.log").write_text("[train] step 1/3 | loss 9.9\n")
    (corpus / "notes" / "logs").mkdir(parents=True)  # the user's own, read as before
    (corpus / "notes" / "logs" / "diary.txt").write_text("Dear diary. Today was long.\n")
    run(prepare_config([str(corpus)], str(corpus / "ds"), str(corpus / "my-vocab.txt")))
    shutil.copytree(corpus / "ds", corpus / "ds-copy")  # an earlier dataset in the folder
    run(prepare_config([str(corpus)], str(tmp_path / "out"), str(corpus / "my-vocab.txt")))
    read = sorted(os.path.relpath(path, corpus)
                  for path in manifest.read_manifest(str(tmp_path / "out")).input_files)
    assert read == ["docs.jsonl", "notes/logs/diary.txt"], read


def test_what_the_input_walk_leaves_out_is_said_once(tmp_path, small_vocab, caplog):
    """The dataset guard and the job walk the same inputs: a rerun of `prepare --input corpus`
    into corpus/ds said "leaving out corpus/ds: a bertforge dataset" twice. The guard's walk,
    which only compares, is quiet; the job's says it."""
    import logging

    from bertforge.cluster.safety.dataset_guard import differences_from_dataset
    from bertforge.pipelines.read.inputs_transform import match_inputs

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = " ".join(f"Sentence number {i} is here." for i in range(12))
    write_jsonl(corpus / "docs.jsonl", [{"text": f"Document {d} begins. " + text}
                                        for d in range(8)])
    config = prepare_config([str(corpus)], str(corpus / "ds"), small_vocab)
    run(config)
    with caplog.at_level(logging.INFO, logger="bertforge.pipelines.read.inputs_transform"):
        assert differences_from_dataset(config.output, config) == []  # the guard's walk
        assert match_inputs(config.inputs, config.output, config.vocab) == [  # the job's
            (str(corpus / "docs.jsonl"), None)]
    said = [r.getMessage() for r in caplog.records if "a bertforge dataset" in r.getMessage()]
    assert said == [f"leaving out {corpus / 'ds'}: a bertforge dataset, not corpus"]
