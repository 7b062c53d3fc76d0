"""The two things a reader yields: a document, or a reject saying what was dropped and why."""

from __future__ import annotations

import json
from typing import NamedTuple

# Reasons that mark a record kept after a fix, not dropped: they are listed in rejects.jsonl and
# counted under `repaired` (not `rejected`) in the manifest, so that input_records still equals
# documents + rejected.
REPAIRED_REASONS = frozenset({"invalid_utf8", "overlong_sentence"})


class RawDocument(NamedTuple):
    doc_id: str
    source: str  # "path:line" (or path:page, path@byte) of the record, for logs and rejects
    text: str | None = None  # free text, to be split into sentences
    sentences: tuple[str, ...] | None = None  # already one sentence per entry


class Reject(NamedTuple):
    reason: str  # e.g. invalid_json, empty_document, too_few_sentences, duplicate_document
    source: str
    doc_id: str = ""
    detail: str = ""

    @property
    def repaired(self) -> bool:
        return self.reason in REPAIRED_REASONS

    def to_json(self) -> str:
        return json.dumps(self._asdict(), ensure_ascii=False, sort_keys=True)
