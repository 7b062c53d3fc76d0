"""The full job translates for Dataflow: DataflowRunner with --dry_run=True, offline.

Needs `apache-beam[gcp]` (the `dataflow` extra); skipped, with the reason, without it.
"""

from __future__ import annotations

import pytest

from bertforge.pipelines.prepare import build_pipeline
from bertforge.pipelines.prepare_options import PrepareConfig

from .conftest import shared_data_file

IMAGE = "us-central1-docker.pkg.dev/test-project/bertforge/worker:0.1.0"


def test_dataflow_dry_run_translates_the_whole_job(tmp_path, corpus_files, small_vocab):
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
    pipeline = build_pipeline(config, beam_args)
    result = pipeline.run()
    job = result.job  # the Dataflow job request, built but not sent
    names = {t.unique_name for t in job.proto_pipeline.components.transforms.values()}
    for step in (
        "PrepareDataset/ReadInputs/ReadFiles",
        "PrepareDataset/CreatePretrainingInstances/CreateInstances",
        "PrepareDataset/WriteShards/WriteShardFiles",
        "PrepareDataset/WriteManifest",
    ):
        assert step in names, step
    images = {env.payload for env in job.proto_pipeline.components.environments.values()}
    assert any(IMAGE.encode() in payload for payload in images)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
