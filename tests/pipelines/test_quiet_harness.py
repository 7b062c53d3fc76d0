"""A local `prepare` on worker processes prints the project's lines only (the workers' warnings
among them), also where Beam's GCP modules half-import: `google.cloud` present without Beam's
clients, as in any install without the dataflow extra (ray[default] brings the namespace). Beam
then logs a root-logger warning while it imports, and logging gave each worker process a stderr
handler of its own: ~25 lines of "INFO:apache_beam.runners.worker.sdk_worker:..." per worker
reached the console."""

import os
import subprocess
import textwrap

from tests.support.console import BERTFORGE, foreign_lines, json_lines
from tests.test_numbers_unchanged import _golden_corpus
from tests.training.conftest import google_layout_vocab


def test_a_local_prepare_on_two_worker_processes_prints_only_its_own_lines(tmp_path):
    # Beam's clients fail to import as they do without the dataflow extra: `apitools` is an
    # ImportError that is not a ModuleNotFoundError (Beam then warns on the root logger).
    stand_in = tmp_path / "site" / "apitools"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text('raise ImportError("apitools: the test\'s stand-in")\n')
    corpus, vocab = tmp_path / "corpus.jsonl", tmp_path / "vocab.txt"
    _golden_corpus(str(corpus))
    # And a book wrapped at 70 columns: a warning that asks the user to act, made in a worker
    # (it stayed in the log, as protobuf text, where one process prints it).
    book = tmp_path / "book.txt"
    paragraph = " ".join(f"The {n}th sentence of the book runs on past the line's end."
                         for n in range(12))
    book.write_text("\n\n".join([textwrap.fill(paragraph, 70)] * 8) + "\n", encoding="utf-8")
    vocab.write_text("\n".join(google_layout_vocab()) + "\n", encoding="utf-8")
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [BERTFORGE, "prepare", "--input", f"{corpus},{book}", "--vocab", str(vocab),
         "--output", str(tmp_path / "shards"), "--max-seq-length", "48",
         "--direct_num_workers=2", "--direct_running_mode=multi_processing"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stdout + result.stderr
    assert foreign_lines(result.stdout, json_lines(result.stdout)) == []
    assert foreign_lines(result.stderr, []) == []
    assert [line for line in result.stderr.splitlines() if "hard-wrapped" in line] == [
        f"[prepare] input {book}: read as a sentence a line, but 92 % of its first 87 lines "
        f"end mid-sentence: hard-wrapped prose, such as a book? Name it books:{book} to read "
        "it as paragraphs"]
    # The stand-in was in effect: the driver's own import warning went to the log file.
    log = (tmp_path / "shards" / "logs" / "prepare.log").read_text(encoding="utf-8")
    assert "apitools not found" in log


def test_a_local_prepare_in_one_process_keeps_its_lines_per_file_and_shard_in_the_log(tmp_path):
    """In one process (no Beam flags, or --direct_num_workers 1) the transforms run in the
    driver, whose console took a line per input file (two) and per shard: thousands on a large
    corpus, where worker processes kept them in the log."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(google_layout_vocab()) + "\n", encoding="utf-8")
    inputs = []
    for index in range(3):
        inputs.append(str(tmp_path / f"part-{index}.jsonl"))
        _golden_corpus(inputs[-1])
    result = subprocess.run(
        [BERTFORGE, "prepare", "--input", ",".join(inputs), "--vocab", str(vocab),
         "--output", str(tmp_path / "shards"), "--max-seq-length", "48", "--num-shards", "4"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert foreign_lines(result.stdout, json_lines(result.stdout)) == []
    console = result.stdout + result.stderr
    assert " (by " not in console and "documents, 0 rejects" not in console, console
    assert "wrote train/" not in console and "wrote rejects.jsonl" not in console, console
    assert "[prepare] done in " in console  # the command's own lines stay
    log = (tmp_path / "shards" / "logs" / "prepare.log").read_text(encoding="utf-8")
    assert log.count("wrote train/part-") == 4 and log.count(": format jsonl (by ") == 3, log
