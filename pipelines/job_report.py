"""What `bertforge prepare` reports when the job does not finish here: a dry run's checks, and a
Dataflow job left running (`--no-wait`). A finished job reports its manifest (`prepare._summary`).

A dry run writes nothing: with `--runner DataflowRunner` Beam builds the whole Dataflow job request
without sending it (offline); with any other runner the pipeline is translated to Beam's portable
form and not run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

from bertforge.pipelines.read.readers import name_format

MAX_LISTED_INPUTS = 20  # a dump split in 60 parts lists 20 and counts the rest


def worker_images(proto: beam_runner_api_pb2.Pipeline) -> list[str]:
    """The container images of the pipeline's Docker environments (what Dataflow workers run)."""
    images = set()
    for env in proto.components.environments.values():
        if env.urn == common_urns.environments.DOCKER.urn:
            images.add(beam_runner_api_pb2.DockerPayload.FromString(env.payload).container_image)
    return sorted(images)


def dry_run_report(
    proto: beam_runner_api_pb2.Pipeline, runner: str, files: list, output: str
) -> dict[str, Any]:
    """What a dry run checked: every step translated, the worker image, the inputs found."""
    transforms = proto.components.transforms.values()
    leaves = [t for t in transforms if not t.subtransforms]
    stages = sorted(
        t.unique_name for t in transforms if t.unique_name.count("/") == 1
    )  # the job's stages: PrepareDataset/ReadInputs, .../WriteShards, ...
    paths = [path for path, _ in files]
    # Prefixes and names are known here; the other files' content is sniffed where they are read.
    formats = Counter(
        f"{forced} (prefix)" if forced else
        f"{name_format(path)} (name)" if name_format(path) else "by content, when read"
        for path, forced in files
    )  # fmt: skip
    report = {
        "dry_run": True,
        "runner": runner,
        "steps_translated": len(leaves),
        "stages": stages,
        "worker_image": (worker_images(proto) or [None])[0],
        "inputs_found": len(paths),
        "input_formats": dict(sorted(formats.items())),
        "input_files": paths[:MAX_LISTED_INPUTS],
        "output": output,
        "written": "nothing (dry run)",
    }
    if len(paths) > MAX_LISTED_INPUTS:
        report["input_files"].append(f"... and {len(paths) - MAX_LISTED_INPUTS} more")
    return report


def submitted_report(job_id: str, options: PipelineOptions, output: str) -> dict[str, Any]:
    """A Dataflow job left running: its id and how to follow it."""
    cloud = options.view_as(GoogleCloudOptions)
    where = f"--project {cloud.project} --region {cloud.region}"
    return {
        "job_id": job_id,
        "follow": f"gcloud dataflow jobs show {job_id} {where}",
        "console": f"https://console.cloud.google.com/dataflow/jobs/{cloud.region}/{job_id}"
        f"?project={cloud.project}",
        "cancel": f"gcloud dataflow jobs cancel {job_id} {where}",
        "output": output,
        "done_when": f"{output}/manifest.json exists (written last)",
    }
