"""The demo's corpus: docstrings parsed (never imported), cleaned to prose, deterministic."""

import json
import sys

import pytest

from bertforge.cluster.demo.docstring_corpus import (
    clean_docstring,
    documents_from_source,
    write_docstring_corpus,
)

# 150 kB of docstrings: ~150 documents, parsed in well under a second.
SMALL_CORPUS_BYTES = 150_000


@pytest.fixture(scope="module")
def docstring_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docstrings.jsonl"
    write_docstring_corpus(str(path), target_bytes=SMALL_CORPUS_BYTES)
    return str(path)


def _records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_corpus_shape_size_and_stats(docstring_corpus, tmp_path):
    records = _records(docstring_corpus)
    assert all(set(r) == {"doc_id", "text"} for r in records)
    assert records[0]["doc_id"].startswith("stdlib:")
    assert len({r["doc_id"] for r in records}) == len(records)
    sizes = [len(r["text"].encode("utf-8")) for r in records]
    # It stops at the first document that reaches the target.
    assert sum(sizes) >= SMALL_CORPUS_BYTES > sum(sizes[:-1])
    for record in records:
        paragraphs = record["text"].split("\n\n")
        assert all(p and "\n" not in p and p == p.strip() for p in paragraphs)
        assert ">>>" not in record["text"]
    stats = write_docstring_corpus(str(tmp_path / "again.jsonl"), SMALL_CORPUS_BYTES)
    assert stats["num_documents"] == len(records) and stats["num_bytes"] == sum(sizes)
    assert stats["sources"] == {"stdlib": {"num_documents": len(records), "num_bytes": sum(sizes)}}


def test_corpus_is_deterministic(docstring_corpus, tmp_path):
    again = tmp_path / "again.jsonl"
    write_docstring_corpus(str(again), SMALL_CORPUS_BYTES)
    with open(docstring_corpus, "rb") as a:
        assert a.read() == again.read_bytes()


def test_modules_are_parsed_not_imported(docstring_corpus):
    """`antigravity` opens a web browser when imported: its docstring must come from its source."""
    assert any(r["doc_id"] == "stdlib:antigravity" for r in _records(docstring_corpus))
    assert "antigravity" not in sys.modules


def test_larger_targets_reach_the_other_sources(tmp_path):
    stats = write_docstring_corpus(str(tmp_path / "big.jsonl"), 1_900_000)
    assert {"stdlib", "pydoc_topics"} <= set(stats["sources"])
    topics = [
        r for r in _records(str(tmp_path / "big.jsonl")) if r["doc_id"].startswith("pydoc_topics:")
    ]
    assert topics and all("\n\n" in r["text"] or len(r["text"]) > 0 for r in topics)


def test_one_document_per_module_and_per_class():
    source = b'''"""Module docstring says what the module is for."""

def helper():
    """The helper function does one useful thing."""

class Widget:
    """A widget is a small thing with a purpose."""

    def spin(self):
        """Spin the widget around its own axis."""
'''
    docs = dict(documents_from_source(source, "pkg.mod"))
    assert docs == {
        "pkg.mod": [
            "Module docstring says what the module is for.",
            "The helper function does one useful thing.",
        ],
        "pkg.mod.Widget": [
            "A widget is a small thing with a purpose.",
            "Spin the widget around its own axis.",
        ],
    }


def test_clean_docstring_drops_code_and_markup():
    docstring = """Return the sum of the values, which is a number.

    This paragraph is wrapped
    over two lines and uses :func:`sum` and ``x``.

    For example::

        total = add(1, 2)
        print(total)

    >>> add(1, 2)
    3

    .. versionadded:: 3.2
       Some version note that is not wanted here.

    :param values: the numbers that are added together.
    :returns: the total of all the values given.

    Parameters
    ----------
    values : list of int
        The numbers that are added together here.

    Examples
    --------
    The examples section is dropped entirely, prose too.
    """
    assert clean_docstring(docstring) == [
        "Return the sum of the values, which is a number.",
        "This paragraph is wrapped over two lines and uses sum and x.",
        "the numbers that are added together.",
        "the total of all the values given.",
        "The numbers that are added together here.",
    ]
