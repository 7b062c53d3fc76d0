"""The demo's built-in corpus: English prose from the docstrings already on this machine.

Sources, in this order, until the requested size is reached:
1. the standard library's modules (parsed with `ast`, never imported: importing `antigravity`
   opens a browser and `this` prints a poem), without tests, `idlelib` and `site-packages`;
2. `pydoc_data.topics`, the language reference topics behind `help()`, one document per topic;
3. the docstrings of installed prose-heavy packages (numpy, pandas, ...), also parsed, not imported.

One document per module (its docstring and its top-level functions') and per top-level class (its
docstring and its methods'). Doctests, literal blocks, reST directives, field lists, tables and
section underlines are dropped; each remaining paragraph becomes one line and short or mostly
non-alphabetic paragraphs (code, signatures) are dropped, so what is left reads as English.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import multiprocessing
import os
import re
import sysconfig
import warnings
from collections.abc import Iterator
from multiprocessing.pool import Pool

logger = logging.getLogger(__name__)

# Installed packages with long prose docstrings, tried in this order after the standard library.
PROSE_PACKAGES = ("numpy", "pandas", "matplotlib", "networkx")
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
# numpy-style sections that hold code, cross references or citations, not prose.
DROPPED_SECTIONS = frozenset({"examples", "see also", "references"})
# reST directives whose body is prose worth keeping.
PROSE_DIRECTIVES = frozenset({"note", "warning", "tip", "important", "attention", "caution"})
MIN_WORDS = 4
MIN_ALPHA_SHARE = 0.6  # letters / non-space characters: rejects code, signatures, tables

_UNDERLINE = re.compile(r"^([=\-~^*+#\"'`])\1{2,}$")
_TABLE_LINE = re.compile(r"^[=\-+| ]{3,}$|^[|+]")
_DIRECTIVE = re.compile(r"^\.\.\s+(?:([\w-]+)::\s*(.*)|.*)$")
_FIELD = re.compile(r"^:[^:`]+:\s*(.*)$")  # ":param x: text", ":returns:", ":rtype: int"
_NUMPY_PARAM = re.compile(r"^[\w*][\w*, ]{0,40} : \S")  # "axis : int, optional"
_BULLET = re.compile(r"^(?:[-*+•]|\d+[.)]|#\.|\([a-z0-9]\))\s+")
_ROLE = re.compile(r":[\w:.+-]+:`~?([^`]*)`")  # :func:`~os.path.join` -> os.path.join
_LITERAL = re.compile(r"``([^`]*)``|`([^`]*)`_{0,2}")
_EMPHASIS = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")
_NOT_LETTERS = re.compile(r"[\W\d_]+")
_TEMPLATE = re.compile(r"%\(\w+\)s|\{\w+\}")  # pandas fills these in at import time


def _inline_markup_to_text(paragraph: str) -> str:
    paragraph = _ROLE.sub(r"\1", paragraph)
    paragraph = _LITERAL.sub(
        lambda m: m.group(1) if m.group(1) is not None else m.group(2), paragraph
    )
    paragraph = _EMPHASIS.sub(lambda m: m.group(1) or m.group(2), paragraph)
    return " ".join(paragraph.split())


def _is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    if len(words) < MIN_WORDS or _TEMPLATE.search(paragraph):
        return False
    non_space = sum(map(len, words))
    letters = len(_NOT_LETTERS.sub("", paragraph))  # a regex pass: 10x a per-character loop
    return letters >= MIN_ALPHA_SHARE * non_space


def _section_headings(lines: list[str]) -> dict[int, str]:
    """{line index: lower-cased title} of numpy/reST headings (a title over an underline)."""
    return {
        i: lines[i].strip().lower()
        for i in range(len(lines) - 1)
        if lines[i].strip() and _UNDERLINE.match(lines[i + 1].strip())
    }


def clean_docstring(docstring: str, *, drop_indented: bool = False) -> list[str]:
    """The prose paragraphs of a docstring, each on one line.

    `drop_indented` drops every indented line: in the pydoc topics, indentation marks code.
    """
    lines = inspect.cleandoc(docstring).splitlines()
    headings = _section_headings(lines)
    paragraphs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        text = _inline_markup_to_text(" ".join(current))
        if _is_prose(text):
            paragraphs.append(text)
        current.clear()

    skip_block_indent: int | None = None  # skip lines indented deeper than this (and blanks)
    skip_until_blank = skip_section = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if i in headings:
            flush()
            skip_section = headings[i] in DROPPED_SECTIONS
            skip_block_indent, skip_until_blank = None, False
            continue
        if skip_section:
            continue
        if skip_until_blank:
            skip_until_blank = bool(stripped)
            continue
        if skip_block_indent is not None:
            if not stripped or indent > skip_block_indent:
                continue
            skip_block_indent = None
        keep, skip = _classify_line(stripped, indent, drop_indented)
        if keep is None or _BULLET.match(stripped) or _FIELD.match(stripped):
            flush()  # a dropped line, a list item or a field starts a new paragraph
        if skip == "until_blank":
            skip_until_blank = True
        elif skip == "block":
            skip_block_indent = indent
        if keep:
            current.append(_BULLET.sub("", keep, count=1))
    flush()
    return paragraphs


def _classify_line(stripped: str, indent: int, drop_indented: bool) -> tuple[str | None, str]:
    """(text to keep or None, what to skip after it: "", "until_blank" or "block")."""
    if not stripped or _UNDERLINE.match(stripped) or _TABLE_LINE.match(stripped):
        return None, ""
    if drop_indented and indent > 0:
        return None, ""
    if stripped.startswith(">>>"):
        return None, "until_blank"  # a doctest: its continuation and output run to a blank line
    directive = _DIRECTIVE.match(stripped)
    if directive:
        name, inline = directive.groups()
        if name in PROSE_DIRECTIVES:
            return (inline or None), ""
        return None, "block"  # code-block, math, versionadded, footnotes, comments ...
    field = _FIELD.match(stripped)
    if field:
        return (field.group(1) or None), ""
    if _NUMPY_PARAM.match(stripped):
        return None, ""
    if stripped.endswith("::"):
        # reST: a paragraph ending in "::" introduces an indented literal (code) block.
        text = stripped[:-2].rstrip()
        return ((text + ":") if text else None), "block"
    return stripped, ""


def _docstring_paragraphs(node: ast.AST) -> list[str]:
    docstring = ast.get_docstring(node, clean=False)
    return clean_docstring(docstring) if docstring else []


def documents_from_source(source: bytes, module_name: str) -> Iterator[tuple[str, list[str]]]:
    """(dotted name, paragraphs) for a module and each of its top-level classes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    module_paragraphs = _docstring_paragraphs(tree)
    for node in tree.body:
        if isinstance(node, functions):
            module_paragraphs += _docstring_paragraphs(node)
    if module_paragraphs:
        yield module_name, module_paragraphs
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            paragraphs = _docstring_paragraphs(node)
            for child in node.body:
                if isinstance(child, functions):
                    paragraphs += _docstring_paragraphs(child)
            if paragraphs:
                yield f"{module_name}.{node.name}", paragraphs


def _python_files(root: str) -> list[str]:
    """Paths relative to `root` of its .py files, sorted, without skipped directories."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    return sorted(found)


def _module_name(rel_path: str, package: str | None) -> str:
    parts = rel_path[: -len(".py")].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(([package] if package else []) + parts) or (package or "")


def _source_documents(label: str, root: str, package: str | None,
                      pool: Pool | None) -> Iterator[tuple[str, str]]:
    """(doc_id, text) for every module and class under `root`, in sorted path order."""
    jobs = [(label, root, rel_path, package) for rel_path in _python_files(root)]
    # Parsing is most of the stage's time; the pool parses ahead, and imap keeps path order.
    for documents in (pool.imap(_file_documents, jobs, chunksize=8) if pool
                      else map(_file_documents, jobs)):
        yield from documents


def _file_documents(job: tuple[str, str, str, str | None]) -> list[tuple[str, str]]:
    label, root, rel_path, package = job
    with open(os.path.join(root, rel_path), "rb") as f:
        source = f.read()
    return [(f"{label}:{name}", "\n\n".join(paragraphs))
            for name, paragraphs in documents_from_source(source, _module_name(rel_path, package))]


def _pydoc_topic_documents() -> Iterator[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics  # plain data, safe to import
    except ImportError:
        return
    for name in sorted(topics):
        paragraphs = clean_docstring(topics[name], drop_indented=True)
        if paragraphs:
            yield f"pydoc_topics:{name}", "\n\n".join(paragraphs)


def _all_documents(pool: Pool | None = None) -> Iterator[tuple[str, str, str]]:
    """(source label, doc_id, text), lazily: files are parsed only when consumed (and, with a
    pool, a little ahead)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for doc_id, text in _source_documents("stdlib", stdlib, None, pool):
        yield "stdlib", doc_id, text
    for doc_id, text in _pydoc_topic_documents():
        yield "pydoc_topics", doc_id, text
    for package in PROSE_PACKAGES:
        spec = importlib.util.find_spec(package)  # finds, does not import
        if spec is None or not spec.submodule_search_locations:
            continue
        root = list(spec.submodule_search_locations)[0]
        for doc_id, text in _source_documents(package, root, package, pool):
            yield package, doc_id, text


def write_docstring_corpus(output_path: str, target_bytes: int = 4_000_000) -> dict:
    """Write JSON Lines `{"doc_id", "text"}` until `target_bytes` of UTF-8 text; return stats.

    Paragraphs are separated by a blank line ("\\n\\n"). The order is deterministic (sources in a
    fixed order, files sorted by path), so the same machine always writes the same file.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    num_documents = num_bytes = 0
    sources: dict[str, dict[str, int]] = {}
    # Two processes (the demo's cores); spawned, as the caller may hold threads (torch, Ray).
    with multiprocessing.get_context("spawn").Pool(2) as pool, \
            open(output_path, "w", encoding="utf-8") as out:
        for label, doc_id, text in _all_documents(pool):
            out.write(json.dumps({"doc_id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            size = len(text.encode("utf-8"))
            num_documents += 1
            num_bytes += size
            source = sources.setdefault(label, {"num_documents": 0, "num_bytes": 0})
            source["num_documents"] += 1
            source["num_bytes"] += size
            if num_bytes >= target_bytes:
                break
    if num_bytes < target_bytes:
        logger.warning(
            "docstring corpus: all sources give only %d of %d bytes", num_bytes, target_bytes
        )
    logger.info(
        "docstring corpus: %d documents, %d bytes -> %s", num_documents, num_bytes, output_path
    )
    return {"num_documents": num_documents, "num_bytes": num_bytes, "sources": sources}
