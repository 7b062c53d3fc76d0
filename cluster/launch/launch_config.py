"""Where and on how many workers a run goes (`LaunchConfig`): the `train`, `finetune` and `glue`
flags and the pipeline file's [cluster] table are generated from its fields.

Apart from `ray_train` so that building the command line imports no Ray: `ray.train.torch` took
4.8 s of a core to import (torch's 2.3 included; 2-core AVX2 EPYC), which every command paid
before its first line, `export` and `inspect` included."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.pipelines.contract.config_fields import option

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


# Where checkpoints persist: fine-tuning keeps none, so `finetune` and `glue` have no flag for it.
FOR_CHECKPOINTS = "for_checkpoints"


@dataclass
class LaunchConfig:
    """Where and on how many workers training runs; `bertforge train` flags and the pipeline
    file's [cluster] table are generated from these fields (`pipelines.contract.config_fields`)."""

    workers: int = option(2, "Ray Train workers (one process each)")
    gpu: bool = option(False, "one GPU per worker")
    cpus_per_worker: int = option(1, "CPUs (and torch threads) per worker")
    address: str | None = option(help="Ray cluster address, 'auto' on a cluster node (default: a "
                                 "private local Ray on 127.0.0.1)")
    # Fine-tuning keeps no checkpoint: "from the newest checkpoint" in its --help was untrue.
    max_failures: int = option(3, "restarts of a failed worker group before giving up (train "
                               "resumes from its newest checkpoint; finetune and glue start the "
                               "unfinished run again, keeping the finished ones)")
    # Where Ray Train persists every rank's checkpoint files (gs://, s3://, or a path all nodes
    # share); None: the run directory itself must be shared storage.
    storage: str | None = option(help="persist every rank's checkpoints to this URI (gs://, "
                                 "s3://) or shared path and restore from it on restart; without "
                                 "it the run directory must be shared", marks=(FOR_CHECKPOINTS,))
    # PACK fills a node before the next (fast collectives); SPREAD puts workers on
    # different nodes (one GPU per node, or testing what crosses the network).
    placement_strategy: str = option("PACK", "SPREAD puts workers on different nodes",
                                     choices=PLACEMENT_STRATEGIES)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be at least 0, got {self.max_failures}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"unknown placement strategy {self.placement_strategy!r}")
        if self.cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be at least 1, got {self.cpus_per_worker}")
        self.address = self.address or None  # "" (a TOML file's "none") is a local Ray too
