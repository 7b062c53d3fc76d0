"""The full job translates for Dataflow: DataflowRunner with --dry_run=True, offline.

Needs `apache-beam[gcp]` (the `dataflow` extra); skipped, with the reason, without it.
"""

from __future__ import annotations

import pytest

from bertforge.pipelines.prepare import build_pipeline

from .conftest import shared_data_file

IMAGE = "us-central1-docker.pkg.dev/test-project/bertforge/worker:0.1.0"


def test_dataflow_dry_run_translates_the_whole_job(tmp_path, corpus_files, small_vocab):
    pytest.importorskip(
        "apache_beam.runners.dataflow.internal.apiclient",
        reason="apache-beam[gcp] is not installed (pip install -e '.[dataflow]')",
    )
    dump = shared_data_file("enwiki-pages-articles-sample.xml.bz2")
    argv = [
        *(f"--input={p}" for p in corpus_files),
        f"--input={dump}",
        f"--output={tmp_path / 'out'}",
        f"--vocab={small_vocab}",
        "--runner=DataflowRunner",
        "--dry_run=True",
        "--project=test-project",
        "--region=us-central1",
        "--temp_location=gs://test-bucket/tmp",
        f"--sdk_container_image={IMAGE}",
        "--sdk_location=container",
    ]
    pipeline, _ = build_pipeline(argv)
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
