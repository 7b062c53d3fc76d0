"""StageRunner's directory rules: other settings are refused once the directory holds work,
and a run that failed before making anything does not pin its settings (the corrected command
simply runs)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from bertforge.cluster.commands.stage_runner import Stage, StageRunner


def failing_stage() -> dict:
    raise ValueError("model work/hf: no such directory")  # a mistyped path, found late


def test_a_run_that_made_nothing_does_not_pin_its_settings(tmp_path, capsys):
    root = tmp_path / "out"
    with pytest.raises(ValueError, match="no such directory"):
        with StageRunner(str(root), "finetune", {"model": "work/hf"}) as runner:
            (root / "logs").mkdir(exist_ok=True)
            (root / "logs" / "finetune.log").write_text("the failure's log")
            runner.run([Stage("run", failing_stage)])

    with StageRunner(str(root), "finetune", {"model": "/abs/work/hf"}) as runner:
        assert runner.run([Stage("run", lambda: {"ok": 1})])["ran"] == ["run"]
    assert "made nothing here; starting afresh" in capsys.readouterr().out


def test_what_a_refused_fine_tunes_worker_left_does_not_pin_its_settings(tmp_path, capsys):
    """A fine-tune its worker refused (SQuAD's doc_stride against the length) left its logs and
    the local worker's spec and error under DIR/runs: the corrected command was refused as
    "made with other settings". A run's own output there still pins them."""
    from bertforge.cluster.commands.finetune_sweep import WORKER_SCRATCH

    root = tmp_path / "out"

    def refused_in_the_worker() -> dict:
        for name in ("runs/logs/worker-0.log", "runs/local-worker.json",
                     "runs/local-worker.error", "runs/ray/state.json"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text("the worker's own")
        (root / "runs" / "lr2e-05-seed1").mkdir()  # made, left empty
        raise ValueError("max_seq_length 128 leaves 61 context tokens")

    with pytest.raises(ValueError, match="61 context tokens"):
        with StageRunner(str(root), "finetune", {"doc_stride": 128},
                         scratch=WORKER_SCRATCH) as runner:
            runner.run([Stage("run", refused_in_the_worker)])
    with StageRunner(str(root), "finetune", {"doc_stride": 32},
                     scratch=WORKER_SCRATCH) as runner:
        (root / "runs" / "lr2e-05-seed1" / "result.json").write_text("{}")  # a run's output
    assert "made nothing here; starting afresh" in capsys.readouterr().out
    with pytest.raises(ValueError, match="made with other settings"):
        with StageRunner(str(root), "finetune", {"doc_stride": 16}, scratch=WORKER_SCRATCH):
            pass


@pytest.mark.parametrize("work", ["a finished stage", "a file a stage wrote"])
def test_a_directory_holding_work_refuses_other_settings_and_says_how_to_keep_it(tmp_path, work):
    root = tmp_path / "out"

    def stage() -> dict:
        (root / "checkpoint.pt").write_bytes(b"hours of training")
        if work == "a file a stage wrote":
            raise RuntimeError("killed before the stage was recorded")
        return {}

    with pytest.raises(RuntimeError) if work == "a file a stage wrote" else nullcontext():
        with StageRunner(str(root), "pipeline", {"steps": 100}) as runner:
            runner.run([Stage("train", stage)])
    with pytest.raises(ValueError, match=r"made with other settings \(differs in: steps\); use "
                                         r"another directory, or delete it to start over"):
        with StageRunner(str(root), "pipeline", {"steps": 200}):
            pass
    assert (root / "checkpoint.pt").exists()


def test_a_setting_recorded_under_its_old_name_still_matches(tmp_path):
    """pipeline.json files written before [vocab] size was spelled vocab_size."""
    root = tmp_path / "out"
    old = {"config": {"vocab": {"size": 2000, "lower_case": True}}}
    with StageRunner(str(root), "pipeline", old) as runner:
        runner.run([Stage("vocab", lambda: {"sha256": "x"})])
    today = {"config": {"vocab": {"vocab_size": 2000, "lower_case": True}}}
    renamed = {"config.vocab.size": "vocab_size"}
    with StageRunner(str(root), "pipeline", today, renamed=renamed) as runner:
        assert runner.run([Stage("vocab", lambda: {})])["skipped"] == ["vocab"]
    with pytest.raises(ValueError, match="differs in: config.vocab.vocab_size"):
        with StageRunner(str(root), "pipeline", {"config": {"vocab": {"vocab_size": 3000,
                                                                      "lower_case": True}}},
                         renamed=renamed):
            pass


@pytest.mark.parametrize("engine_note, said", [
    ("", "export unfinished: the same command runs export again, the stages done kept"),
    ("no checkpoint was committed yet", "no checkpoint was committed yet; the same command "
     "runs export again, the stages done kept"),
    ("the same command continues it (its work is in W)",
     "the same command continues it (its work is in W)")])
def test_a_stop_during_a_stage_says_what_the_same_command_does(tmp_path, engine_note, said):
    """A Ctrl-C during the pipeline's vocabulary or export (or a training before its first
    checkpoint) said "stopped by SIGINT" alone; a note that says it already is kept as it is."""
    import signal

    from bertforge.cluster.launch.local_ray import StoppedBySignal

    def stopped() -> dict:
        raise StoppedBySignal(signal.SIGINT, engine_note)

    with pytest.raises(StoppedBySignal) as stop:
        with StageRunner(str(tmp_path / "work"), "pipeline", {}) as runner:
            runner.run([Stage("vocab", lambda: {}), Stage("export", stopped)])
    assert stop.value.describe() == f"stopped by SIGINT; {said}"
    assert stop.value.code == 128 + signal.SIGINT


def test_a_refused_directory_is_not_left_locked(tmp_path):
    """The refusal is raised inside `with StageRunner(...)`'s enter: the lock it had taken
    stayed held while the error was referenced, and the corrected call in the same process
    was refused as "another bertforge pipeline is running" (its own pid)."""
    root = str(tmp_path / "work")
    with StageRunner(root, "pipeline", {"num_shards": 2}) as runner:
        runner.run([Stage("vocab", lambda: {})])
    with pytest.raises(ValueError, match="made with other settings") as refused:
        with StageRunner(root, "pipeline", {"num_shards": 3}):
            pass
    with StageRunner(root, "pipeline", {"num_shards": 2}) as runner:
        assert runner.run([Stage("vocab", lambda: {})])["skipped"] == ["vocab"]
    assert refused.value  # kept until here, as a caller's `except ... as error` keeps it


def test_the_same_job_started_twice_together_is_told_the_first_is_running(tmp_path,
                                                                          monkeypatch):
    """Two `bertforge pipeline` runs of one job started together: the second looked at the
    directory while the first, its lock taken, was writing its state, took the state's temp
    file for someone else's and told the user to choose an empty directory (seen with three
    real processes starting runners together). Now it is told that the first one runs."""
    import os

    from bertforge.cluster.safety.run_lock import RunDirectoryInUse

    root = tmp_path / "job"
    replace, second_run = os.replace, []

    def the_second_starts_while_the_first_writes_its_state(source, destination):
        if destination == str(root / "pipeline.json") and not second_run:
            try:
                with StageRunner(str(root), "pipeline", {"a": 1}):
                    second_run.append("held")
            except (RunDirectoryInUse, ValueError) as error:
                second_run.append(str(error))
        return replace(source, destination)

    monkeypatch.setattr(os, "replace", the_second_starts_while_the_first_writes_its_state)
    with StageRunner(str(root), "pipeline", {"a": 1}):
        pass
    assert len(second_run) == 1
    assert second_run[0].startswith(f"another bertforge pipeline is running in {root} ")
