import gzip
import io
import json

from bertforge.pipelines.read.input_files import iter_texts
from bertforge.pipelines.read.readers import (
    RawDocument,
    Reject,
    doc_id_prefixes,
    format_extension,
    read_documents,
)


def _read(path: str, data: bytes, prefix: str = "f.jsonl"):
    return list(read_documents(path, prefix, io.BytesIO(data)))


def test_jsonl_records_ids_and_rejects():
    lines = [
        json.dumps({"text": "First. Second.", "doc_id": "wiki:1"}),
        "",
        json.dumps({"text": "No id here. Two sentences."}),
        "{not json",
        json.dumps({"title": "no text"}),
        json.dumps({"text": "   "}),
    ]
    out = _read("dir/f.jsonl", ("\n".join(lines) + "\n").encode())
    # A record's own id, within its file: another file's "wiki:1" is another document.
    assert out[0] == RawDocument("f.jsonl:wiki:1", "dir/f.jsonl:1", text="First. Second.")
    # Record indices count records, not lines: the blank line is no record.
    assert out[1] == RawDocument("f.jsonl:1", "dir/f.jsonl:3", text="No id here. Two sentences.")
    assert [(r.reason, r.doc_id) for r in out[2:]] == [
        ("invalid_json", "f.jsonl:2"),
        ("missing_text", "f.jsonl:3"),
        ("empty_document", "f.jsonl:4"),
    ]
    assert all(isinstance(r, Reject) for r in out[2:])


def test_sentence_per_line_documents_split_on_blank_lines():
    data = b"One sentence.\nAnother one.\n\n\nSecond document.\nIts end.\n  \nThird.\n"
    out = _read("books.txt", data, prefix="books.txt")
    assert [d.doc_id for d in out] == ["books.txt:0", "books.txt:1", "books.txt:2"]
    assert out[0].sentences == ("One sentence.", "Another one.")
    assert out[1].source == "books.txt:5"
    assert out[2].sentences == ("Third.",)


WIKIEXTRACTOR = b"""<doc id="12" url="https://en.wikipedia.org/wiki?curid=12" title="Anarchism">
Anarchism

Anarchism is a political philosophy. It is skeptical of authority.
History
Humans lived without formal hierarchies &amp; states &lt;long&gt; before.
</doc>
<doc id="25" url="https://en.wikipedia.org/wiki?curid=25" title="AT&amp;T">
AT&amp;T
</doc>
<doc id="39" url="https://en.wikipedia.org/wiki?curid=39" title="Cut">
Cut
The file ends inside this block.
"""


def test_wikiextractor_blocks_are_documents_without_their_tags_and_titles():
    """WikiExtractor's default output (`AA/wiki_00`, which the README names) was read as a
    sentence a line: `<doc id=...>` and `</doc>` became training text and the blocks' bounds
    were lost."""
    from bertforge.pipelines.read.readers import choose_format

    assert choose_format("wx/AA/wiki_00", None, WIKIEXTRACTOR).fmt == "wikiextractor"
    out = list(read_documents("wx/AA/wiki_00", "wiki_00", io.BytesIO(WIKIEXTRACTOR),
                              "wikiextractor"))
    # Each line its own paragraph, so the heading stays a sentence apart from the next one.
    # Page ids within their file: two dumps' ids overlap.
    assert out[0] == RawDocument("wiki_00:12", "wx/AA/wiki_00:1", text=(
        "Anarchism is a political philosophy. It is skeptical of authority.\n\nHistory\n\n"
        "Humans lived without formal hierarchies & states <long> before."))
    assert (out[1].reason, out[1].doc_id) == ("empty_document", "wiki_00:25")  # its title only
    assert out[2] == RawDocument("wiki_00:39", "wx/AA/wiki_00:11",
                                 text="The file ends inside this block.")
    assert len(out) == 3


def test_format_is_chosen_by_extension_past_compression():
    assert format_extension("a/b.jsonl.gz") == ".jsonl"
    assert format_extension("b.JSON") == ".json"
    assert format_extension("wiki.txt.bz2") == ".txt"


def test_doc_id_prefixes_disambiguate_equal_base_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefixes = doc_id_prefixes(["a/part.jsonl", "b/part.jsonl", "c/other.jsonl"])
    assert prefixes == {
        "a/part.jsonl": "a/part.jsonl",
        "b/part.jsonl": "b/part.jsonl",
        "c/other.jsonl": "other.jsonl",
    }
    # However the paths are spelled (they were the prefixes, so the dataset's bytes changed
    # with the working directory): below the colliding files' common folder.
    spelled = [str(tmp_path / "corpus" / "AA" / "wiki_00"), "./corpus/AB/wiki_00",
               "gs://bucket/x/AA/wiki_00.jsonl", "gs://bucket/y/AA/wiki_00.jsonl"]
    assert list(doc_id_prefixes(spelled).values()) == [
        "AA/wiki_00", "AB/wiki_00", "x/AA/wiki_00.jsonl", "y/AA/wiki_00.jsonl"]


def test_iter_texts_streams_compressed_files(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "Hello there. General."}) + "\nbroken\n")
    plain = tmp_path / "d.txt"
    plain.write_text("Line one.\nLine two.\n\nLine three.\n", encoding="utf-8")
    texts = iter_texts([str(path), str(plain)])
    assert not isinstance(texts, list)
    assert list(texts) == ["Hello there. General.", "Line one.", "Line two.", "Line three."]


def test_hard_wrapped_prose_read_as_sentences_is_doubted_and_sentences_are_not():
    """A book's .txt without `books:` is read a sentence a line: every wrapped line a sentence
    (a newcomer's run: NSP cut at random places, 1,494 paragraphs rejected as too short), and
    the console said nothing. Its format stays what the content says; the doubt is warned."""
    import random
    import textwrap

    from bertforge.pipelines.read.readers import choose_format

    rng = random.Random(3)
    words = ["the", "whale", "sea", "captain", "ship", "long", "night", "under", "grey", "sky"]
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 30))).capitalize()
                 + "." for _ in range(300)]
    wrapped = "\n\n".join(textwrap.fill(" ".join(sentences[i:i + 6]), width=70)
                          for i in range(0, 300, 6))
    one_a_line = "\n".join(sentences)
    book = choose_format("book.txt", None, wrapped.encode()[:8192])
    assert book.fmt == "sentences" and book.chosen_by == "content"
    assert "end mid-sentence: hard-wrapped prose, such as a book?" in book.doubt
    assert choose_format("sents.txt", None, one_a_line.encode()[:8192]).doubt == ""
    assert choose_format("book.txt", "books", wrapped.encode()).doubt == ""  # named: trusted
