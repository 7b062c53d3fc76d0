"""Wiki markup cleaning: each construct on a hand-written snippet, then the four real dumps."""

from __future__ import annotations

import pytest

from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.records import RawDocument
from bertforge.pipelines.read.wikitext import wikitext_to_paragraphs

from .conftest import shared_data_file

# What must never survive cleaning (XML is already unescaped: `&lt;` would be a double escape).
RESIDUE = ("{{", "}}", "[[", "]]", "<ref", "{|", "|}", "&lt;", "&amp;", "&nbsp;", "File:")
RESIDUE += ("Image:", "Category:", "__", "'''", "<!--", "</")
DUMPS = (
    "enwiki-wikibrain-en_test.xml.bz2",  # schema 0.8
    "enwiki-pages-articles-sample.xml.bz2",  # 0.9
    "enwiki-table-markup.xml.bz2",  # 0.10
    "enwiki-20250201-tiny_dump.xml.bz2",  # 0.11
)


def _clean(wikitext: str) -> str:
    return "\n\n".join(wikitext_to_paragraphs(wikitext))


@pytest.mark.parametrize(
    ("wikitext", "expected"),
    [
        ("A {{cite|x={{nested|y}}}} b.", "A b."),
        ("Text<ref name=a>{{cite web|url=x}}</ref> more<ref name=a/>.", "Text more."),
        ("Before <!-- hidden [[x]] --> after.", "Before after."),
        ("[[Paris|the capital]] and [[London]]s.", "the capital and Londons."),
        ("[[File:X.jpg|thumb|A [[caption]] link]] Prose.", "Prose."),
        ("[[Image:Y.png|left]]Prose [[Category:Cities]][[de:Stadt]].", "Prose."),
        ("See [[:Category:Cities|the list]].", "See the list."),
        ("[[wikt:word|word]] here.", "word here."),
        ("An [http://example.com external link] and [http://x.org].", "An external link and."),
        ("'''Bold''' and ''italic'' and '''''both'''''.", "Bold and italic and both."),
        ("__TOC__\nText.", "Text."),
        ("Text &nbsp;x&ndash;y.", "Text x–y."),
        ("x <math>a^2</math> y <sub>2</sub> <b>bold</b>.", "x y 2 bold."),
        ("<gallery>\nA.jpg|cap\n</gallery>\nText.", "Text."),
        ("Intro.\n{|\n|-\n| cell {{t}}\n{|\n| inner\n|}\n|}\nAfter.", "Intro.\n\nAfter."),
        ("== Heading ==\nBody line one\nline two.", "Body line one line two."),
        ("Intro.\n* item one\n# item two\nEnd.", "Intro.\n\nitem one\n\nitem two\n\nEnd."),
        ("Prose.\n== See also ==\n* [[Other]]\n== References ==\n{{reflist}}", "Prose."),
        ("Prose.\n\n==External links==\n* [http://x y]", "Prose."),
        # A closing title inside the article (a subsection) cuts nothing: only the last run of
        # closing sections goes.
        ("A.\n== Culture ==\n=== Literature ===\nB.\n=== Film ===\nC.\n== Notes: ==\nx",
         "A.\n\nB.\n\nC."),
        ("A.\n=== Publications ===\nList.\n== History ==\nB.", "A.\n\nList.\n\nB."),
        # Subsections of a closing section are closing too (bibliographies and link lists
        # were kept from "See also" on: 1.2 % of the excerpts' text).
        ("A.\n==See also==\n* x\n==Further reading==\n===Primary sources===\n* Jin, Ha. "
         "War Trash.\n==External links==\n* y", "A."),
        ("A.\n==External links==\n===Official===\n* site\n===Organizations===\n* org", "A."),
        ("Name ({{IPA|x}}) is.", "Name is."),
        ("Unclosed {{template at the end", "Unclosed"),
        ("A &lt;ref&gt;typed escaped&lt;/ref&gt; ref.", "A ref."),
        ("Line<br/>break.", "Line break."),
    ],
)
def test_each_construct(wikitext, expected):
    assert _clean(wikitext) == expected


@pytest.mark.parametrize("name", DUMPS)
def test_real_dumps_leave_no_markup(name):
    path = str(shared_data_file(name))
    docs = [d for d in read_file(path, name, "wiki", open_local) if isinstance(d, RawDocument)]
    assert docs
    for doc in docs:
        for residue in RESIDUE:
            assert residue not in doc.text, (doc.source, residue)
        # Trailing sections are gone: their headings' words do not end an article.
        assert not doc.text.rstrip().endswith(("References", "External links"))
