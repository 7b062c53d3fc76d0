"""How a checkpoint is scored (`EvalOptions`): `bertforge eval`'s flags are generated from these
fields. Apart from `training.evaluate` so that building the command line imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.pipelines.contract.config_fields import option


@dataclass(frozen=True)
class EvalOptions:
    """How `evaluate_checkpoint` scores: `bertforge eval`'s flags are generated from these."""

    split: str = option("validation", "the split to score", choices=("train", "validation"))
    batch_size: int = option(64, "sequences per batch")
    max_batches: int | None = option(
        help="score only the first N batches (default: the whole split); of the train "
        "split the baseline then guesses those rows' most frequent token")
    seed: int | None = option(
        help="the seed of the masks and of the batches' order (default: the checkpoint's "
        "training seed, as its run's validation and the demo's eval)")
    verify_checksums: bool = option(
        True, "hash the shards against the manifest's sha256 (rows are validated either way)")
    device: str = option(
        "auto", "where to score: auto (a GPU when there is one, else the CPU), cpu or cuda; "
        "on a GPU a bf16 run's checkpoint is scored under bf16 autocast, any other in fp32",
        choices=("auto", "cpu", "cuda"))

    def __post_init__(self) -> None:
        # Refused with the flags, before the command's start line and the engines.
        for name in ("batch_size", "max_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
