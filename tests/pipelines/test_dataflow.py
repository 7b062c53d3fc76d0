"""The full job translates for Dataflow: DataflowRunner with --dry_run=True, offline.

Needs `apache-beam[gcp]` (the `dataflow` extra); skipped, with the reason, without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from bertforge.pipelines.prepare import build_pipeline, dataflow_job_request
from bertforge.pipelines.prepare_options import PrepareConfig

from .conftest import shared_data_file

IMAGE = "us-central1-docker.pkg.dev/test-project/bertforge/worker:0.1.0"


def test_dataflow_dry_run_translates_the_whole_job(tmp_path, corpus_files, small_vocab,
                                                   monkeypatch):
    pytest.importorskip(
        "apache_beam.runners.dataflow.internal.apiclient",
        reason="apache-beam[gcp] is not installed (pip install -e '.[dataflow]')",
    )
    dump = shared_data_file("enwiki-pages-articles-sample.xml.bz2")
    config = PrepareConfig(
        inputs=(*(p for entry in corpus_files for p in entry.split(",")), str(dump)),
        output=str(tmp_path / "out"), vocab=small_vocab,
    )
    beam_args = [
        "--runner=DataflowRunner",
        "--dry_run=True",
        "--project=test-project",
        "--region=us-central1",
        "--temp_location=gs://test-bucket/tmp",
        f"--sdk_container_image={IMAGE}",
        "--sdk_location=container",
    ]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    pipeline = build_pipeline(config, beam_args)
    proto = dataflow_job_request(pipeline)  # the Dataflow job request's, built but not sent
    names = {t.unique_name for t in proto.components.transforms.values()}
    for step in (
        "PrepareDataset/ReadInputs/ReadFiles",
        "PrepareDataset/CreatePretrainingInstances/CreateInstances",
        "PrepareDataset/WriteShards/WriteShardFiles",
        "PrepareDataset/WriteManifest",
    ):
        assert step in names, step
    images = {env.payload for env in proto.components.environments.values()}
    assert any(IMAGE.encode() in payload for payload in images)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert os.listdir(temporary) == []  # nor leaves what a submission would stage


def test_a_dataflow_dry_run_leaves_nothing_in_the_temporary_directory(tmp_path, corpus_files,
                                                                      small_vocab):
    """Beam's translation for Dataflow wrote what a submission stages into TMPDIR and left it:
    a `tmp*` folder (pickled_main_session, submission_environment_dependencies.txt) and
    `beam-requirements-cache`; the command's log, which holds nothing the console did not
    show, was left there too, named nowhere. A dry run stages nothing: TMPDIR stays empty."""
    pytest.importorskip(
        "apache_beam.runners.dataflow.internal.apiclient",
        reason="apache-beam[gcp] is not installed (pip install -e '.[dataflow]')",
    )
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "bertforge.cluster.cli", "prepare", f"--input={corpus_files[0]}",
         f"--output={tmp_path / 'out'}", f"--vocab={small_vocab}", "--runner",
         "DataflowRunner", "--dry_run=True", "--project=test-project", "--region=us-central1",
         "--temp_location=gs://test-bucket/tmp", f"--sdk_container_image={IMAGE}",
         "--sdk_location=container"],
        capture_output=True, text=True, env={**os.environ, "TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dry_run"] is True
    assert os.listdir(temporary) == []
    assert not (tmp_path / "out").exists()


def test_dataflow_dry_run_through_the_cli_exits_0_and_says_what_it_checked(
    tmp_path, corpus_files, small_vocab, capsys
):
    pytest.importorskip(
        "apache_beam.runners.dataflow.internal.apiclient",
        reason="apache-beam[gcp] is not installed (pip install -e '.[dataflow]')",
    )
    from bertforge.cluster.cli import main as cli_main

    output = tmp_path / "out"
    argv = ["prepare", f"--output={output}", f"--vocab={small_vocab}"]
    argv += [f"--input={entry}" for entry in corpus_files]
    argv += [
        "--runner", "DataflowRunner", "--dry_run=True", "--project=test-project",
        "--region=us-central1", "--temp_location=gs://test-bucket/tmp",
        f"--sdk_container_image={IMAGE}", "--sdk_location=container",
    ]  # fmt: skip
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("{") :])
    assert report["dry_run"] is True and report["worker_image"] == IMAGE
    assert report["inputs_found"] == 4 and report["steps_translated"] > 50
    assert sum(report["input_formats"].values()) == 4 and "jsonl (name)" in report["input_formats"]
    assert "PrepareDataset/WriteManifest" in report["stages"]
    assert not output.exists()  # nothing written, not even the output directory
    # Its local files translate, but it says what a real run refuses (it was not said).
    refused = report["a_real_run_is_refused"]
    assert refused[0].startswith("--input ") and "workers cannot read it" in refused[0]
    assert refused[-1].startswith(f"--output {output} is on this machine")
    # The real run is refused before anything is sent or written.
    argv.remove("--dry_run=True")
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bertforge prepare: error: --runner DataflowRunner: --input ") and \
        "Dataflow's workers cannot read it" in err, err
    assert not output.exists()


def test_no_wait_is_taken_out_of_the_job_flags_and_the_follow_commands():
    from apache_beam.options.pipeline_options import PipelineOptions

    from bertforge.pipelines.job_report import submitted_report
    from bertforge.pipelines.prepare_options import parse_command_line

    command = parse_command_line(["--input=x", "--output=o", "--vocab=v", "--no-wait",
                                  "--runner=DataflowRunner"])
    assert command.beam_args == ("--runner=DataflowRunner",) and not command.wait
    options = PipelineOptions(["--project=p", "--region=europe-west4"])
    report = submitted_report("2026-11-23_12_00_00-123", options, "gs://b/shards")
    assert report["follow"] == (
        "gcloud dataflow jobs show 2026-11-23_12_00_00-123 --project p --region europe-west4"
    )
    assert "jobs/europe-west4/2026-11-23_12_00_00-123?project=p" in report["console"]


def test_a_waited_for_dataflow_job_that_fails_or_is_left_says_so_in_a_line(capsys):
    """A failed job was Beam's DataflowRuntimeException as a traceback; a Ctrl-C while waiting
    said "stopped" while the job ran on, billed, without a word of how to cancel it."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from bertforge.pipelines.job_report import submitted_report
    from bertforge.pipelines.prepare import _dataflow_job_ended

    job = submitted_report("2026-11-27_10_00_00-42", PipelineOptions(
        ["--project=p", "--region=us-central1"]), "gs://b/shards")
    failure = RuntimeError("Dataflow pipeline failed. State: FAILED, Error:\nTraceback (most "
                           "recent call last):\n  File \"x.py\", line 1\nValueError: no usable "
                           "document remains\n")
    with pytest.raises(ValueError) as raised:
        _dataflow_job_ended(job, failure)
    assert str(raised.value) == (
        "Dataflow job 2026-11-27_10_00_00-42 did not succeed: Dataflow pipeline failed. State: "
        "FAILED, Error: ... ValueError: no usable document remains (its log: "
        "https://console.cloud.google.com/dataflow/jobs/us-central1/2026-11-27_10_00_00-42"
        "?project=p)")
    with pytest.raises(KeyboardInterrupt):
        _dataflow_job_ended(job, KeyboardInterrupt())
    assert capsys.readouterr().err == (
        "[prepare] the Dataflow job 2026-11-27_10_00_00-42 goes on without this process; to "
        "stop it: gcloud dataflow jobs cancel 2026-11-27_10_00_00-42 --project p --region "
        "us-central1\n")


def test_another_runners_failure_is_one_line(tmp_path, corpus_files, small_vocab, capsys,
                                             monkeypatch):
    """FlinkRunner offline (its job server's jar cannot be fetched) was Beam's 184-line
    traceback. The runner's start fails here as it does offline, without the network."""
    import apache_beam as beam

    from bertforge.cluster.cli import main as cli_main

    def cannot_start(pipeline):
        raise RuntimeError("Unable to fetch remote job server jar at https://repo.maven.apache"
                           ".org/x.jar: <urlopen error [Errno -2] Name or service not known>")

    monkeypatch.setattr(beam.Pipeline, "run", cannot_start)
    output = tmp_path / "out"
    assert cli_main(["prepare", f"--output={output}", f"--vocab={small_vocab}",
                     f"--input={corpus_files[0]}", "--runner", "FlinkRunner"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bertforge prepare: error: --runner FlinkRunner: the job did not succeed: "
                   "Unable to fetch remote job server jar at https://repo.maven.apache.org/x.jar: "
                   "<urlopen error [Errno -2] Name or service not known>"], err
    assert not output.exists()


def test_a_job_written_as_a_template_is_not_waited_for():
    """With --template_location Dataflow creates no job (`job_id()` of None: an AttributeError
    where the report named the job); a local run's result is no template."""
    from apache_beam.runners.dataflow.dataflow_runner import DataflowPipelineResult
    from apache_beam.runners.runner import PipelineState

    from bertforge.pipelines.prepare import only_a_template

    assert only_a_template(DataflowPipelineResult(None, None))

    class LocalResult:  # the local runners' results have no has_job
        state = PipelineState.DONE

    assert not only_a_template(LocalResult())


def test_an_invalid_bucket_is_one_line_at_once_not_a_two_minute_hang(
    tmp_path, corpus_files, small_vocab, capsys
):
    """The README's own placeholder (`gs://BUCKET/tmp`: upper case is no bucket name) made the
    Dataflow client retry for two minutes, then print a 190-line traceback."""
    from bertforge.cluster.cli import main as cli_main

    argv = ["prepare", f"--output={tmp_path / 'out'}", f"--vocab={small_vocab}",
            f"--input={corpus_files[0]}", "--runner", "DataflowRunner", "--dry_run=True",
            "--project=test-project", "--region=us-central1", "--temp_location=gs://BUCKET/tmp"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bertforge prepare: error: --temp_location gs://BUCKET/tmp: 'BUCKET' is not a "
                   "Cloud Storage bucket name (3-63 lower-case letters, digits, '-', '_' or '.'); "
                   "give a bucket of your project"]
