"""Read a GLUE-format TSV into examples: tab-separated, NO quoting, one clear error per bad line.

GLUE's files hold `"` inside the text (RTE, MRPC, STS-B): csv's default quoting would join rows, so
every line is split on tabs and nothing else. Lines end in `\\n` only (a trailing `\\r` is dropped);
`str.splitlines` is not used because it also breaks on characters such as U+2028 inside a sentence.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from bertforge.training.finetune.tasks import Column, TaskSpec


@dataclass
class Example:
    text_a: str
    text_b: str | None
    label: int | float  # a label id (position in TaskSpec.labels), or the score of a regression
    line: int  # 1-based line in its file, for error messages and predictions


def read_lines(path: str) -> list[str]:
    """The file's lines without line ends; a UTF-8 BOM (MRPC has one) and trailing blank lines
    are dropped. Raises ValueError when the file holds no line at all."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not UTF-8 text ({error.reason})") from None
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ValueError(f"{path}, line 1: the file is empty")
    return lines


def _resolve(column: Column, header: list[str] | None, num_fields: int, path: str) -> int:
    """The field index of `column`, or a ValueError naming the file's first line."""
    if isinstance(column, int):
        if not 0 <= column < num_fields:
            raise ValueError(
                f"{path}, line 1: no column {column}: the lines have {num_fields} fields"
                " (columns are 0-based)"
            )
        return column
    if header is None or column not in header:
        known = f"the header has {header}" if header is not None else "the file has no header"
        raise ValueError(f"{path}, line 1: no column {column!r}: {known}")
    return header.index(column)


def _shortened(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _label_list(labels: tuple[str, ...], shown: int = 10) -> str:
    """The labels, the first `shown` of many (a text column taken for the label column made
    one label a sentence: the error was a 30 KB line)."""
    if len(labels) <= shown:
        return f"labels {list(labels)}"
    return (f"{len(labels)} labels, the first {[_shortened(label) for label in labels[:shown]]}"
            " (is --label-column a text column?)")


def _parse_label(field: str, spec: TaskSpec, path: str, line: int) -> int | float:
    if spec.labels is not None:
        value = field.strip()
        if value not in spec.labels:
            raise ValueError(f"{path}, line {line}: unknown label {_shortened(value)!r}; task "
                             f"{spec.name} has {_label_list(spec.labels)}")
        return spec.labels.index(value)
    try:
        score = float(field)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise ValueError(f"{path}, line {line}: label {field!r} is not a finite number")
    if spec.score_range is not None and not spec.score_range[0] <= score <= spec.score_range[1]:
        low, high = spec.score_range
        # A score outside the task's scale is a damaged file (another column read as the
        # score, say), which would train and report without a word.
        raise ValueError(f"{path}, line {line}: score {field!r} is outside task {spec.name}'s "
                         f"{low:g}-{high:g}")
    return score


def read_table(path: str, has_header: bool) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """(header or None, [(line number, fields)]): every data line split on tabs, each with as
    many fields as the header (or, without one, the first line)."""
    lines = read_lines(path)
    header = lines[0].split("\t") if has_header else None
    first = 2 if has_header else 1  # line number of the first data line
    data = lines[1:] if has_header else lines
    if not data:
        raise ValueError(f"{path}, line {first}: no examples after the header")
    num_fields = len(header) if header is not None else len(data[0].split("\t"))
    rows = []
    for number, text in enumerate(data, start=first):
        fields = text.split("\t")
        if len(fields) != num_fields:
            raise ValueError(
                f"{path}, line {number}: {len(fields)} tab-separated fields, expected"
                f" {num_fields} (GLUE files are split on tabs, with no quoting)"
            )
        rows.append((number, fields))
    return header, rows


def read_examples(path: str, spec: TaskSpec) -> list[Example]:
    """Every data line of `path` as an Example (header skipped when `spec.has_header`)."""
    header, rows = read_table(path, spec.has_header)
    num_fields = len(rows[0][1])
    text_fields = [_resolve(c, header, num_fields, path) for c in spec.text_columns]
    label_field = _resolve(spec.label_column, header, num_fields, path)
    if header is not None:
        _refuse_data_as_header(path, spec, header[label_field])
    examples = []
    for number, fields in rows:
        label = _parse_label(fields[label_field], spec, path, number)
        text_b = fields[text_fields[1]] if len(text_fields) > 1 else None
        examples.append(Example(fields[text_fields[0]], text_b, label, number))
    return examples


def _refuse_data_as_header(path: str, spec: TaskSpec, label: str) -> None:
    """A file without a header, read with one (the default), lost its first example without a
    word. Columns given by index are the sign (names are read from a header, which then is
    one), and a first line whose label cell is one of the task's labels (or a score)."""
    by_index = all(isinstance(c, int) for c in (*spec.text_columns, spec.label_column))
    is_label = label.strip() in spec.labels if spec.labels is not None else _is_number(label)
    if by_index and is_label:
        raise ValueError(f"{path}, line 1: read as a header (the default), but its label "
                         f"{_shortened(label.strip())!r} is one of the task's labels: a data "
                         "line? Give --no-has-header for a file without a header")


def _is_number(field: str) -> bool:
    try:
        return math.isfinite(float(field))
    except ValueError:
        return False


def read_label_set(path: str, spec: TaskSpec) -> tuple[str, ...]:
    """The distinct labels of a file's label column, sorted (integers numerically): the label set
    of a custom classification task whose labels the user did not list."""
    header, rows = read_table(path, spec.has_header)
    field = _resolve(spec.label_column, header, len(rows[0][1]), path)
    counts: Counter[str] = Counter()
    for number, fields in rows:
        value = fields[field].strip()
        if not value:  # a label left out, not a class of its own
            raise ValueError(f"{path}, line {number}: the label is empty")
        counts[value] += 1
    values = set(counts)
    fractions = sorted(v for v in values if _is_number(v) and not float(v).is_integer())
    if fractions and all(_is_number(v) for v in values):
        # Scores (STS-B's 0-5) read as classes trained a classifier of one class per score.
        raise ValueError(f"{path}: the label column holds scores such as "
                         f"{', '.join(fractions[:3])} ({len(values)} distinct values), not "
                         "classes: give --regression for a score, or --labels for classes")
    # Integers (signed too: -1 and +1) in numeric order, so that the positive class of a
    # binary task is the last, the one its F1 scores.
    numeric = all(_is_integer(v) for v in values)
    first = rows[0][1][field].strip()
    if (not spec.has_header and counts[first] == 1 and not _is_integer(first)
            and len(values) > 2 and all(_is_integer(v) for v in values - {first})):
        # A header read as data (--no-has-header on a file that has one) became a class.
        raise ValueError(f"{path}, line 1: label {first!r} is the one label that is no number, "
                         "and only this line has it: a header line? Drop --no-has-header, or "
                         "list the classes with --labels")
    return tuple(sorted(values, key=int if numeric else str))


def _is_integer(label: str) -> bool:
    return label.lstrip("+-").isdigit()
