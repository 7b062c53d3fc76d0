"""Checkpoints: DeepSpeed state on every rank plus a commit marker written last.

Layout under a run directory:

    checkpoints/step_00000300/            one DeepSpeed tag
        mp_rank_00_model_states.pt        DeepSpeed (module, client_state)
        *_optim_states.pt                 DeepSpeed (one per data-parallel rank under ZeRO)
        rng_rank_00000.pt                 each rank's torch RNG (dropout), tensors only
        bertforge.json                    model config, vocab hash, casing: enough to export/eval
        vocab.txt                         a copy, so the checkpoint stands alone
        COMMITTED                         JSON {step, ...}: the checkpoint counts only with it

A kill while saving leaves a tag without COMMITTED; it is ignored on resume and removed later.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
METADATA_NAME = "bertforge.json"
_TAG_PATTERN = re.compile(r"^step_(\d{8})$")


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR)


def committed_steps(run_dir: str) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _TAG_PATTERN.match(name)
        if match and os.path.exists(os.path.join(root, name, COMMIT_MARKER)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    steps = committed_steps(run_dir)
    return os.path.join(checkpoints_root(run_dir), tag_for_step(steps[-1])) if steps else None


def save(
    engine, run_dir: str, step: int, client_state: dict[str, Any], *,
    metadata: dict[str, Any], vocab_path: str, keep: int,
) -> str:
    """Collective: every rank calls it. Returns the checkpoint path once committed."""
    root = checkpoints_root(run_dir)
    tag = tag_for_step(step)
    engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(root, tag)
    torch.save(_rng_state(), os.path.join(path, f"rng_rank_{rank:05d}.pt"))
    if rank == 0:
        with open(os.path.join(path, METADATA_NAME), "w", encoding="utf-8") as f:
            json.dump({**metadata, "global_step": step}, f, indent=2, sort_keys=True)
        shutil.copyfile(vocab_path, os.path.join(path, "vocab.txt"))
    _barrier()  # every rank's files are on disk before the marker says so
    if rank == 0:
        _write_marker(path, {"step": step, "time": time.time()})
        _prune(run_dir, keep)
    _barrier()
    return path


def load(engine, checkpoint_path: str) -> dict[str, Any]:
    """Restore DeepSpeed state and this rank's RNG; returns the client_state."""
    root, tag = os.path.split(checkpoint_path.rstrip("/"))
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    verify_safe_to_unpickle(checkpoint_path)
    _, client_state = engine.load_checkpoint(root, tag=tag)
    if client_state is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint at {checkpoint_path}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(checkpoint_path, f"rng_rank_{rank:05d}.pt")
    if os.path.exists(rng_path):  # absent when resuming on more ranks than were saved
        _set_rng_state(torch.load(rng_path, weights_only=True))
    return client_state


def verify_safe_to_unpickle(checkpoint_path: str) -> None:
    """Refuse a checkpoint whose .pt files hold anything but tensors, plain data and DeepSpeed's
    few plain-data classes.

    DeepSpeed's own loaders call torch.load(weights_only=False), which would run whatever a
    tampered file asks for; each file must first pass torch's restricted unpickler (memory-
    mapped, so tensors are not read twice).
    """
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for name in sorted(os.listdir(checkpoint_path)):
            if not name.endswith(".pt"):
                continue
            path = os.path.join(checkpoint_path, name)
            try:
                torch.load(path, weights_only=True, mmap=True, map_location="cpu")
            except pickle.UnpicklingError as error:
                raise ValueError(
                    f"{path} holds objects outside the types a checkpoint may contain; "
                    f"refusing to load it ({str(error).splitlines()[0]})"
                ) from None


def _deepspeed_safe_globals() -> list:
    """The non-tensor classes DeepSpeed pickles into ZeRO checkpoints: plain data holders.

    `getattr` is how pickle rebuilds an enum member (getattr(ZeroStageEnum, "gradients")),
    seen in multi-rank checkpoints. Allowing it only yields attributes: torch's restricted
    unpickler still calls nothing that is not on this list.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, getattr]


def read_metadata(checkpoint_path: str) -> dict[str, Any]:
    """The checkpoint's bertforge.json; a clear error when the path is no complete checkpoint."""
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    with open(os.path.join(checkpoint_path, METADATA_NAME), encoding="utf-8") as f:
        return json.load(f)


def resolve_checkpoint(path: str) -> str:
    """Accept a checkpoint directory or a run directory (then its newest complete checkpoint)."""
    if os.path.exists(os.path.join(path, COMMIT_MARKER)):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a complete checkpoint nor a run with one")
    return latest


def load_fp32_state_dict(checkpoint_path: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage, without a DeepSpeed engine.

    Under ZeRO the fp32 master weights are partitioned across the ranks' optimizer files;
    DeepSpeed's own zero_to_fp32 reassembles them (bf16 module weights would lose precision).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, tag = os.path.split(checkpoint_path.rstrip("/"))
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    verify_safe_to_unpickle(checkpoint_path)
    if _is_zero_checkpoint(checkpoint_path):
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    else:  # ZeRO stage 0: the module states file holds the full weights
        files = [f for f in os.listdir(checkpoint_path) if f.endswith("model_states.pt")]
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            blob = torch.load(os.path.join(checkpoint_path, sorted(files)[0]), weights_only=True)
        state = blob["module"]
    return {name: tensor.float() for name, tensor in state.items()}


def _is_zero_checkpoint(checkpoint_path: str) -> bool:
    return any(name.endswith("_optim_states.pt") and "zero" in name
               for name in os.listdir(checkpoint_path))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_marker(path: str, payload: dict[str, Any]) -> None:
    tmp = os.path.join(path, COMMIT_MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, os.path.join(path, COMMIT_MARKER))


def _prune(run_dir: str, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints; drop older ones and stale partial saves."""
    steps = committed_steps(run_dir)
    if not steps:
        return
    keep_steps = set(steps[-keep:])
    root = checkpoints_root(run_dir)
    for name in os.listdir(root):
        match = _TAG_PATTERN.match(name)
        if match and int(match.group(1)) not in keep_steps and int(match.group(1)) < steps[-1]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load_model(checkpoint_path: str):
    """An fp32 `BertForPreTraining` with the checkpoint's weights, and its metadata."""
    from training.model import BertConfig, BertForPreTraining

    metadata = read_metadata(checkpoint_path)
    model = BertForPreTraining(BertConfig.from_dict(metadata["model_config"]))
    state = load_fp32_state_dict(checkpoint_path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The MLM decoder is tied to the word embeddings, so a checkpoint may carry it once.
    missing = [name for name in missing if name != "cls.predictions.decoder.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_path} does not match its model config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model, metadata
