"""`bertforge export`: any complete checkpoint to a Hugging Face directory."""

from __future__ import annotations

import os

from bertforge.training.checkpoint import load_model, resolve_checkpoint
from bertforge.training.hf_interop import export_hf_directory


def export_checkpoint(checkpoint_or_run_dir: str, output_dir: str) -> str:
    """Write config.json, model.safetensors, vocab and tokenizer files; returns output_dir."""
    checkpoint_path = resolve_checkpoint(checkpoint_or_run_dir)
    model, metadata = load_model(checkpoint_path)
    return export_hf_directory(
        model.state_dict(), model.config, os.path.join(checkpoint_path, "vocab.txt"),
        metadata["lower_case"], output_dir,
    )
