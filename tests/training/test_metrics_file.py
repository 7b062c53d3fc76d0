"""RUN_DIR/metrics.jsonl after a write that a full disk or a power loss cut short."""

from __future__ import annotations

import json
import tracemalloc

from bertforge.training.metrics import METRICS_NAME, MetricsLogger, read_metrics


def test_a_torn_last_record_neither_stops_a_resume_nor_swallows_the_next(tmp_path):
    """A record cut mid-write (ENOSPC, a power loss) made every resume fail on a JSON error
    naming no file, and a run appending after it wrote its first record onto the torn line."""
    records = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)]
    (tmp_path / METRICS_NAME).write_text("".join(records) + '{"step": 4, "lo')
    logger = MetricsLogger(str(tmp_path), enabled=True, max_steps=10, resumed_step=2)
    logger.log(3, {"loss": 0.5})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(1, 1.0), (2, 1.0),
                                                                           (3, 0.5)]

    # A run that had saved nothing starts again beside the torn record (no resume to drop it).
    (tmp_path / METRICS_NAME).write_text(records[0] + '{"step": 2, "lo')
    logger = MetricsLogger(str(tmp_path), enabled=True, max_steps=10)
    logger.log(1, {"loss": 0.7})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(1, 1.0), (1, 0.7)]
    MetricsLogger(str(tmp_path), enabled=True, max_steps=10, resumed_step=1).close()
    lines = (tmp_path / METRICS_NAME).read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [1.0, 0.7]  # the torn one dropped


def test_the_logger_keeps_no_record_in_memory(tmp_path):
    """A run of weeks logs as long: the records it kept in memory on every rank, never read,
    grew each worker by ~0.5 KB a log line (half a GB at a million lines, --log-every 1)."""
    metrics = {name: 1.0 for name in ("loss", "mlm_loss", "nsp_loss", "lr", "seq_per_s",
                                      "tokens_per_s", "tflops", "mfu", "tokens")}
    for enabled in (True, False):  # rank 0, and the ranks that write nothing
        logger = MetricsLogger(str(tmp_path / str(enabled)), enabled=enabled, max_steps=10**6)
        logger.log(1, metrics)  # the first line's one-off allocations (the file's buffer)
        tracemalloc.start()
        for step in range(2, 2002):
            logger.log(step, dict(metrics))
        grown, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        logger.close()
        assert grown < 200_000, f"{grown:,} bytes held after 2,000 log lines"
