"""Pre-flight: the driver checks a command's inputs in seconds, before Ray or any engine starts.

A wrong --data, a damaged dataset, a run directory that cannot be written or a resume with
another architecture would otherwise be found inside the Ray workers, minutes later, and be
retried as if a node had died. The checks themselves are pure functions of training/
(`training.inputs`); this module decides which ones each command needs.

For other commands (e.g. `bertforge finetune`): `preflight_model` is a building block; it raises
a one-line `UserInputError`.
"""

from __future__ import annotations

from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from bertforge.training.inputs import (
    check_checkpoint,
    check_dataset,
    check_model_source,
    check_output_dir,
    check_positions,
    check_resume,
    check_run_dir,
    resolve_model_config,
)


def preflight_model(source: str) -> str:
    """A pretrained model: a complete checkpoint, a run directory with one, or a Hugging Face
    directory (config.json and weights); returns the checkpoint path, or `source` itself."""
    return check_model_source(source)


def preflight_train(cfg: TrainConfig) -> None:
    """Everything `train` can know before its workers start: data, run directory, the model
    against the data's lengths, a resume against the requested architecture, --init-from."""
    facts = check_dataset(cfg.data_dir, ("train", "validation") if cfg.eval_every else ("train",))
    check_run_dir(cfg.run_dir)
    model_config = resolve_model_config(cfg.model, facts.vocab_size)
    check_positions(facts.max_seq_length, model_config, cfg.data_dir)
    resumed = check_resume(cfg.run_dir, model_config, facts.vocab_sha256) if cfg.resume else None
    if resumed is None and cfg.init_from:
        preflight_model(cfg.init_from)


def preflight_eval(checkpoint: str, data_dir: str, split: str) -> None:
    """`eval`: the checkpoint resolves and the dataset's split opens with the same vocabulary."""
    from bertforge.training.inputs import read_checkpoint_metadata

    resolved = check_checkpoint(checkpoint)
    facts = check_dataset(data_dir, (split, "train"))  # train: the MLM baseline's frequencies
    saved = read_checkpoint_metadata(resolved)
    if saved.get("vocab_sha256") != facts.vocab_sha256:
        raise UserInputError(f"{data_dir} uses another vocabulary than checkpoint {resolved}")


def preflight_export(checkpoint: str, output: str) -> None:
    """`export`: the checkpoint resolves and the output directory can be written."""
    check_checkpoint(checkpoint)
    check_output_dir(output)
