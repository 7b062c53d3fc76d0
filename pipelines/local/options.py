"""The local runner's flags (Beam pipeline options, so `prepare` accepts them beside Beam's)."""

from __future__ import annotations

from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions

from bertforge.pipelines.local.progress import PROGRESS_SECONDS
from bertforge.pipelines.local.runner import MAX_BUNDLE_BYTES


class LocalRunnerOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser: Any) -> None:  # Beam's hook
        cls.add_flags(parser)

    @classmethod
    def add_flags(cls, parser: Any) -> None:
        """The flags, on any argparse parser or group (`prepare --help` shows them)."""
        parser.add_argument(
            "--local_bundle_mb", "--local-bundle-mb", dest="local_bundle_mb", type=float,
            default=None,
            help=f"local runs: MB of input a worker is sent at once (default: "
            f"{MAX_BUNDLE_BYTES / 2**20:g}). What the run holds in memory is about "
            "(workers + 1) x (their base size + a few bundles) whatever the corpus size; a "
            "smaller value lowers it a little, fewer --direct_num_workers lowers it most. The "
            "output is the same bytes whatever the value.")
        parser.add_argument(
            "--quiet", dest="quiet", action="store_true", default=None,
            help="print the summary only: no progress lines")
        parser.add_argument(
            "--progress_seconds", "--progress-seconds", dest="progress_seconds", type=float,
            default=None, help=f"local runs: seconds between progress lines (default: "
            f"{PROGRESS_SECONDS:g})")


def local_processes(workers: int) -> list[str]:
    """Beam's flags for a local run on `workers` worker processes (one core each)."""
    return [f"--direct_num_workers={workers}", "--direct_running_mode=multi_processing"]


def bundle_bytes(options: PipelineOptions) -> int:
    value = options.view_as(LocalRunnerOptions).local_bundle_mb
    if value is None:
        return MAX_BUNDLE_BYTES
    if value <= 0:
        raise ValueError(f"--local_bundle_mb must be positive, got {value:g}")
    return max(1, int(value * 2**20))


def progress_seconds(options: PipelineOptions) -> float:
    value = options.view_as(LocalRunnerOptions).progress_seconds
    if value is not None and value <= 0:
        raise ValueError(f"--progress_seconds must be positive, got {value:g}")
    return PROGRESS_SECONDS if value is None else value
