"""What every step of the preparation job shares: its metrics namespace and the rejects output."""

from __future__ import annotations

from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput

from bertforge.pipelines.read.records import Reject

METRICS_NAMESPACE = "bertforge.prepare"
REJECTS = "rejects"  # the tag of every step's side output of `Reject`s
LOG_EVERY_DOCUMENTS = 10_000
# Counters of the word pieces tokenized, and of those that are [UNK].
TOKENIZED_PIECES, UNKNOWN_PIECES = "tokenized_pieces", "unknown_pieces"
# Counters of the instances made, and of those whose second segment is a random one.
INSTANCES, RANDOM_NEXT = "instances", "random_next"
NO_DOCUMENTS_MESSAGE = "no usable document remains"
NO_INSTANCES_MESSAGE = "no training instance was made"
# The job's own refusals, said in one line (Beam wraps a step's error in its traceback).
JOB_REFUSALS = (NO_DOCUMENTS_MESSAGE, NO_INSTANCES_MESSAGE)


def count(name: str, value: int = 1) -> None:
    Metrics.counter(METRICS_NAMESPACE, name).inc(value)


def reject_output(reject: Reject) -> TaggedOutput:
    """Count a reject (`rejected_<reason>`, or `repaired_<reason>`) and route it to REJECTS."""
    count(f"{'repaired' if reject.repaired else 'rejected'}_{reject.reason}")
    return TaggedOutput(REJECTS, reject)


def reject(reason: str, source: str, doc_id: str = "", detail: str = "") -> TaggedOutput:
    return reject_output(Reject(reason, source, doc_id, detail))
