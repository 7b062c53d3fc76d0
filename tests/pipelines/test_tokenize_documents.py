"""Long documents are tokenized in parts: the parts must give exactly the whole document's Doc."""

import random

import pytest

from bertforge.pipelines.instances.tokenize_transform import TokenizeParts, assemble, document_parts
from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.records import RawDocument
from tests.pipelines.conftest import shared_data_file


def _tokenize(raw: RawDocument, vocab_bytes: bytes, part_chars: int):
    """The Doc (or rejects) of `raw`, cut into parts of `part_chars` and put back together."""
    tokenize = TokenizeParts(vocab_bytes, lower_case=True)
    tokenize.setup()
    parts = [p for part in document_parts(raw, part_chars) for p in tokenize.process(part)]
    random.Random(0).shuffle(parts)  # parts arrive in any order after the shuffle
    return list(assemble(parts)), len(parts)


def _paragraphs(num: int) -> str:
    rng = random.Random(num)
    words = ["alpha", "beta", "gamma", "Dr. Who", "3.14", '"quoted."', "delta"]
    paragraphs = []
    for p in range(num):
        sentences = [
            " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))).capitalize() + "."
            for _ in range(rng.randint(1, 6))
        ]
        gap = rng.choice(["\n\n", "\n \n", "\r\n\r\n", "\n\n\n\t\n"])
        paragraphs.append((f"Heading {p}" if p % 7 == 0 else " ".join(sentences)) + gap)
    return "".join(paragraphs)


@pytest.mark.parametrize("part_chars", [1, 50, 333, 10_000_000])
def test_text_cut_into_parts_gives_the_whole_documents_doc(small_vocab, part_chars):
    raw = RawDocument("doc", "src:1", text=_paragraphs(300))
    vocab_bytes = open(small_vocab, "rb").read()
    whole, num_whole = _tokenize(raw, vocab_bytes, 10**9)
    cut, num_parts = _tokenize(raw, vocab_bytes, part_chars)
    assert num_whole == 1
    assert num_parts > 1 or part_chars == 10_000_000
    assert cut == whole and len(whole) == 1 and whole[0].num_sentences > 300


@pytest.mark.parametrize("part_chars", [1, 40, 10_000_000])
def test_sentence_lists_cut_into_parts_give_the_whole_documents_doc(small_vocab, part_chars):
    sentences = tuple(f"Sentence number {i} is here." for i in range(200))
    raw = RawDocument("doc", "src:1", sentences=sentences)
    vocab_bytes = open(small_vocab, "rb").read()
    assert _tokenize(raw, vocab_bytes, part_chars)[0] == _tokenize(raw, vocab_bytes, 10**9)[0]


def test_a_real_book_in_parts_equals_the_book_whole(small_vocab):
    path = shared_data_file("melville-moby_dick.txt")
    (raw,) = [r for r in read_file(str(path), "moby", "books", open_local)]
    vocab_bytes = open(small_vocab, "rb").read()
    whole, _ = _tokenize(raw, vocab_bytes, 10**9)
    cut, num_parts = _tokenize(raw, vocab_bytes, 65_536)
    assert num_parts > 10
    assert cut == whole


def test_rejects_are_decided_on_the_whole_document(small_vocab):
    vocab_bytes = open(small_vocab, "rb").read()
    # One sentence per paragraph, two paragraphs: each part alone has one sentence, the document 2.
    two = RawDocument("two", "src:2", text="First one.\n\nSecond one.")
    (doc,) = _tokenize(two, vocab_bytes, 1)[0]
    assert doc.num_sentences == 2
    one = RawDocument("one", "src:3", text="\n\nOnly one sentence\n\n\n")
    (rejected,) = _tokenize(one, vocab_bytes, 1)[0]
    assert rejected.value.reason == "too_few_sentences"
    # Two lines of Google's format, one of which tokenizes to nothing (a repaired byte, a
    # zero-width space): one sentence of tokens, which cannot make a pair either.
    for blank in ("\ufffd\ufffd", "\u200b"):
        hollow = RawDocument("hollow", "src:4", sentences=("Doc two line one.", blank))
        (rejected,) = _tokenize(hollow, vocab_bytes, 1)[0]
        assert (rejected.value.reason, rejected.value.detail) == (
            "too_few_sentences", "1 sentence with tokens")


def test_records_sharing_doc_id_and_source_stay_apart(small_vocab):
    """A dump may hold one page twice (same id and title), with the same or another text."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that, equal_to

    from bertforge.pipelines.instances.tokenize_transform import TokenizeDocuments

    vocab_bytes = open(small_vocab, "rb").read()
    first = RawDocument("page", "dump:7 Page", text=_paragraphs(40))
    other = RawDocument("page", "dump:7 Page", text=_paragraphs(41))
    expected = [_tokenize(raw, vocab_bytes, 10**9)[0][0] for raw in (first, first, other)]
    # The FnApiRunner: Beam's DirectRunner first tries Prism, whose failed start offline left a
    # beam-temp* folder and two others in TMPDIR each time.
    with TestPipeline(runner=FnApiRunner(), options=PipelineOptions([])) as pipeline:
        tokenized = (
            pipeline
            | beam.Create([first, other, first])
            | TokenizeDocuments(vocab_bytes, lower_case=True, part_chars=300)
        )
        assert_that(tokenized["docs"], equal_to(expected))
