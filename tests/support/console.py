"""What a `bertforge` command printed, split into the project's lines and anything else: the
quiet-console tests fail on the latter."""

from __future__ import annotations

import json
import os
import re
import sys

BERTFORGE = os.path.join(os.path.dirname(sys.executable), "bertforge")
# What the project prints (see cluster/, training/): stage, progress and step lines are
# "[command] ...", notices and errors "bertforge ...: ...". A command's result (train's and
# eval's JSON, export's directory) is checked apart, as the output's end.
PROJECT_LINE = re.compile(r"^(\[(train|eval|export|finetune|glue|demo|prepare|pipeline)\] |"
                          r"bertforge( \w+)?: )")


def foreign_lines(console: str, result: list[str]) -> list[str]:
    """The console's lines that are neither the project's nor the command's `result` lines."""
    lines = console.splitlines()
    body = lines[:len(lines) - len(result)] if result else lines
    assert lines[len(body):] == result, console  # the result ends the output
    return [line for line in body if line.strip() and not PROJECT_LINE.match(line)]


def json_lines(stdout: str) -> list[str]:
    """The JSON document that ends `stdout`, as printed."""
    lines = stdout.splitlines()
    start = len(lines) - 1 - lines[::-1].index("{")
    json.loads("\n".join(lines[start:]))
    return lines[start:]
