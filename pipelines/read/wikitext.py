"""MediaWiki markup -> clean plain-text paragraphs, the way BERT's Wikipedia corpus was made.

Google: "For Wikipedia we extract only the text passages and ignore lists, tables, and headers."
Here, per construct:
- dropped with their content: comments, `<ref>`s, templates `{{...}}` (nested), tables `{|...|}`
  (nested), `[[File:]]`/`[[Image:]]`/`[[Category:]]`/interlanguage links (captions included),
  non-prose tags (`<math>`, `<gallery>`, `<timeline>`, ...), magic words (`__TOC__`), headings,
  horizontal rules, and everything from the first trailing section on ("References",
  "External links", "See also", "Notes", "Further reading", ...);
- kept as text: link labels (`[[a|b]]` -> b, `[[a]]` -> a, `[http://x y]` -> y), the inner text of
  inline tags (`<b>`, `<span>`, `<sub>`...), bold/italic text without its quotes;
- list items (`*`, `#`, `;`, `:`) are kept, each as its own paragraph, so that an item is never
  glued to the sentence before it; drop them downstream if a corpus should have prose only.

Templates, tables and links nest, which no regular expression matches: `_outer_spans` scans
opening/closing tokens with a depth counter instead (linear time, no recursion), so a 2 MB
article with a thousand templates costs one pass per construct.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

# Sections that close an article and hold no prose. The text is cut where the last run of
# them begins (`cut_trailing_sections`).
TRAILING_SECTIONS = (
    "references",
    "external links",
    "see also",
    "notes",
    "further reading",
    "bibliography",
    "sources",
    "citations",
    "footnotes",
    "notes and references",
    "references and notes",
    "works cited",
    "literature",
    "selected bibliography",
    "publications",
    "discography",
    "filmography",
)
# Tags whose content is not prose: dropped whole.
DROPPED_TAGS = (
    "math",
    "chem",
    "ce",
    "gallery",
    "timeline",
    "imagemap",
    "score",
    "syntaxhighlight",
    "source",
    "graph",
    "mapframe",
    "maplink",
    "hiero",
    "templatedata",
    "inputbox",
    "categorytree",
    "references",
    "ref",
    "table",
    "code",
    "pre",
)
# Link namespaces that render no inline text (or an image): the whole link goes.
DROPPED_NAMESPACES = frozenset({"file", "image", "category", "media"})
# Inline interwiki prefixes: `[[wikt:word|word]]` shows "word" in the article.
INLINE_INTERWIKI = frozenset(
    {"wikt", "wiktionary", "s", "wikisource", "commons", "q", "wikiquote", "n", "wikinews", "b"}
    | {"wikibooks", "v", "wikiversity", "species", "m", "meta", "mw", "w", "wikipedia", "d"}
    | {"wikidata", "voy", "wikivoyage"}
)

# Any section heading, `== Title ==` at any level (an optional colon after the title).
_SECTION_HEADING = re.compile(r"^[ \t]*(=+)[ \t]*(.*?)[ \t]*:?[ \t]*\1[ \t]*$", re.MULTILINE)
_TRAILING_TITLES = frozenset(TRAILING_SECTIONS)
_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.DOTALL)
_DROPPED_TAG_BLOCK = re.compile(
    r"<(" + "|".join(DROPPED_TAGS) + r")\b[^>]*?(?:/>|>.*?(?:</\1\s*>|\Z))",
    re.IGNORECASE | re.DOTALL,
)
# Closing or self-closing leftovers of dropped tags, e.g. a stray `</ref>`.
_STRAY_DROPPED_TAG = re.compile(r"</?(?:" + "|".join(DROPPED_TAGS) + r")\b[^>]*>", re.IGNORECASE)
_BREAK_TAG = re.compile(r"<br\s*/?>", re.IGNORECASE)
_HTML_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*(?:\s[^<>]*)?/?>")
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}")
_TABLE_TOKEN = re.compile(r"^[ \t:]*\{\||^[ \t]*\|\}", re.MULTILINE)
_LINK_TOKEN = re.compile(r"\[\[|\]\]")
_EXTERNAL_LINK = re.compile(
    r"\[(?:https?:|ftp:|//|mailto:|news:|irc:|gopher:)[^\s\]]*(?:[ \t]+([^\]\n]*))?\]",
    re.IGNORECASE,
)
_BOLD_ITALIC = re.compile(r"'''''|'''|''")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_HEADING = re.compile(r"^=+.*=+$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_LANGUAGE_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z]{2,8})*$")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")
_LEADING_PUNCT = re.compile(r"^[\s.,;:)\]]+")
_SPACES = re.compile(r"[ \t\u00a0\u2009\u200b]+")
_LETTER = re.compile(r"[^\W\d_]")
_WORD_CHAR = re.compile(r"[^\W_]")


def wikitext_to_paragraphs(wikitext: str) -> list[str]:
    """Plain-text paragraphs of an article, in order; list items are paragraphs of their own."""
    text = cut_trailing_sections(wikitext)
    text = _COMMENT.sub("", text)
    # Entities first too: `&lt;ref&gt;` typed into an article is a (botched) tag, not prose.
    text = html.unescape(text) if "&" in text else text
    text = _DROPPED_TAG_BLOCK.sub("", text)
    text = _STRAY_DROPPED_TAG.sub("", text)
    text = remove_nested(text, _TEMPLATE_TOKEN, "{{")
    text = remove_nested(text, _TABLE_TOKEN, "{|", keep=lambda span: "")
    text = remove_nested(text, _LINK_TOKEN, "[[", keep=_link_text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _BREAK_TAG.sub(" ", text)
    text = _HTML_TAG.sub("", text)
    text = _BOLD_ITALIC.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    return _paragraphs(text)


def cut_trailing_sections(wikitext: str) -> str:
    """The article up to its closing sections: the last run of headings that are all closing
    ones ("See also", "References", ... at any level) or lie within one (`===Primary
    sources===` under `==Further reading==`, an external link list's `===Official===`). A
    closing title inside the article, a `=== Literature ===` under "In culture" followed by
    "=== Film ===", cuts nothing."""
    cut, closing_level = None, 0  # where the run starts, its shallowest closing heading
    for heading in _SECTION_HEADING.finditer(wikitext):
        level = len(heading.group(1))
        if heading.group(2).lower() in _TRAILING_TITLES:
            if cut is None:
                cut, closing_level = heading.start(), level
            closing_level = min(closing_level, level)
        elif cut is not None and level <= closing_level:
            cut = None  # the article goes on
    return wikitext if cut is None else wikitext[:cut]


def _outer_spans(text: str, token: re.Pattern, opener: str) -> list[tuple[int, int]]:
    """(start, end) of every outermost balanced construct; an unclosed one runs to the end.

    Closing tokens with no opener are left alone here (a lone `}}` is text to MediaWiki too) and
    removed by the caller's final clean-up.
    """
    spans, depth, start = [], 0, 0
    for match in token.finditer(text):
        if match.group().lstrip(" \t:").startswith(opener):
            if depth == 0:
                start = match.start()
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                spans.append((start, match.end()))
    if depth > 0:
        spans.append((start, len(text)))
    return spans


def remove_nested(
    text: str,
    token: re.Pattern,
    opener: str,
    keep: Callable[[str], str] = lambda span: "",
) -> str:
    """Replace each outermost construct by `keep(its source)`; stray tokens are removed."""
    pieces, position = [], 0
    for start, end in _outer_spans(text, token, opener):
        pieces.append(text[position:start])
        pieces.append(keep(text[start:end]))
        position = end
    pieces.append(text[position:])
    return token.sub("", "".join(pieces))


def _link_text(link: str) -> str:
    """The text a `[[...]]` link shows: its label, or its target; nothing for files/categories."""
    inner = link[2:-2] if link.endswith("]]") else link[2:]
    target, _, label = inner.partition("|")
    shown_colon = target.lstrip().startswith(":")  # [[:Category:X]] is a visible link
    namespace, has_colon, rest = target.strip().lstrip(":").partition(":")
    if has_colon and not shown_colon:
        if namespace.strip().lower() in DROPPED_NAMESPACES:
            return ""
        if _LANGUAGE_PREFIX.match(namespace) and namespace not in INLINE_INTERWIKI:
            return ""  # interlanguage link: shown in the sidebar, not in the text
    if label:
        # Nested links inside a label (rare outside file captions) are resolved too.
        return remove_nested(label.rsplit("|", 1)[-1], _LINK_TOKEN, "[[", keep=_link_text)
    shown = target.strip().lstrip(":")
    if has_colon and namespace.strip().lower() in INLINE_INTERWIKI:
        shown = rest
    return shown.split("#", 1)[0] or shown.lstrip("#")


def _paragraphs(text: str) -> list[str]:
    """Lines -> paragraphs: blank lines end one, list items are one each, headings go."""
    paragraphs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    for raw_line in text.split("\n"):
        line = raw_line.strip()
        if not line or _HEADING.match(line) or line.startswith("----"):
            flush()
            continue
        if line[0] in "|!" or not _WORD_CHAR.search(line):
            continue  # a table row whose opener was lost; a brace of preformatted code
        if line[0] in "*#:;":
            flush()
            current.append(_LIST_MARKER.sub("", line))
            flush()
            continue
        current.append(line)
    flush()
    cleaned = (_clean_paragraph(p) for p in paragraphs)
    return [p for p in cleaned if _LETTER.search(p)]


def _clean_paragraph(paragraph: str) -> str:
    # Entities last: `&lt;ref&gt;` written in the wikitext is text, not a tag to remove.
    text = html.unescape(paragraph)
    text = _SPACES.sub(" ", text)
    text = _EMPTY_BRACKETS.sub("", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _LEADING_PUNCT.sub("", text)  # what was left of a line after a formula or template
    return _SPACES.sub(" ", text).strip()
