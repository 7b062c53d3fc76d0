"""The chain's stage bodies, shared by `bertforge pipeline` and `bertforge demo`:

    vocab -> prepare -> train -> export

Each orchestrator makes its own `Stage`s (names, directory layout, when a stage counts as done)
from these functions, parameterised by what it configures; none has stage bodies of its own for
these four. Each body returns the record the stage runner keeps, and leaves either its complete
output or something the next attempt replaces: the vocab and the export are written beside their
place and renamed in, prepare continues a killed attempt's recorded work (or starts over), and
training resumes from its newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: Beam, Ray and torch load only for the stage that runs
    from bertforge.cluster.launch.launch_config import LaunchConfig
    from bertforge.pipelines.prepare_options import PrepareConfig
    from bertforge.pipelines.vocab_options import VocabConfig
    from bertforge.training.config import TrainConfig

VOCAB_NAME = "vocab.txt"


def make_vocab(config: VocabConfig, existing: str | None = None) -> dict[str, Any]:
    """`config.output`/vocab.txt: a copy of `existing`, or a WordPiece vocabulary trained as
    `config` says (inputs read as prepare reads them, format prefixes included). Either is
    written beside its place and renamed in, so a half-written vocab.txt never "exists"."""
    from bertforge.pipelines.contract.manifest import sha256_file

    path = os.path.join(config.output, VOCAB_NAME)
    os.makedirs(config.output, exist_ok=True)
    if existing:
        if not os.path.isfile(existing):
            raise ValueError(f"vocab.path {existing} does not exist")
        shutil.copyfile(existing, path + ".tmp")
        os.replace(path + ".tmp", path)
        return {"source": existing, "sha256": sha256_file(path)}
    from bertforge.pipelines.vocab import train_wordpiece_vocab

    train_wordpiece_vocab(config)
    # What it was trained on, as prepare's manifest records its inputs: a later run whose
    # inputs changed is told (`vocab_change`), where the old vocabulary was kept unsaid.
    return {"source": "trained", "sha256": sha256_file(path), "inputs": vocab_inputs(config)}


def vocab_complete(vocab_dir: str) -> bool:
    return os.path.isfile(os.path.join(vocab_dir, VOCAB_NAME))


def vocab_inputs(config: VocabConfig) -> dict[str, int | None]:
    """{where each file is: its size} of the files `config` trains on as they are now; a
    pattern that matches nothing any more adds none (the corpus deleted since)."""
    from bertforge.pipelines.filesystem import sizes_of
    from bertforge.pipelines.read.inputs_transform import match_inputs
    from bertforge.pipelines.read.readers import input_location

    paths = []
    for pattern in config.inputs:
        with contextlib.suppress(ValueError):
            paths += [path for path, _ in match_inputs((pattern,), config.output, quiet=True)]
    sizes = sizes_of(paths)
    return {input_location(path): sizes.get(path) for path in paths}


def vocab_change(config: VocabConfig, existing: str | None, recorded: dict[str, Any] | None,
                 moved: tuple[str, str] | None = None) -> str:
    """How the vocabulary `config.output` holds is no longer what the configuration makes
    ("" when it is): `existing` (a `[vocab] path`) edited since it was copied, or, for a
    trained one, input files added or of another size since (its `recorded` stage record;
    one recorded without them cannot say). Files deleted since are no change, as for the
    shards: the vocabulary is all that is left of them. `moved`: (from, to), the folder moved
    whole since."""
    from bertforge.pipelines.contract.manifest import sha256_file
    from bertforge.pipelines.dataset_identity import moved_location

    copy = os.path.join(config.output, VOCAB_NAME)
    if existing:
        if os.path.isfile(existing) and sha256_file(existing) != sha256_file(copy):
            return f"vocab.path {existing} changed since it was copied to {copy}"
        return ""
    if not isinstance((recorded or {}).get("inputs"), dict):
        return ""
    before = {moved_location(location, moved): size
              for location, size in recorded["inputs"].items()}
    now = vocab_inputs(config)
    new = sorted(set(now) - set(before))
    resized = sorted(path for path in set(now) & set(before) if now[path] != before[path])
    if not new and not resized:
        return ""
    named = "; ".join(filter(None, (_some("new", new), _some("another size", resized))))
    return f"the input files {copy} was trained on changed since ({named})"


def _some(what: str, paths: list[str], most: int = 3) -> str:
    if not paths:
        return ""
    more = f" and {len(paths) - most} more" if len(paths) > most else ""
    return f"{what}: {', '.join(paths[:most])}{more}"


def prepare_dataset(config: PrepareConfig, beam_args: Sequence[str]) -> dict[str, Any]:
    """The Beam job for `config` into config.output. A stop ends Beam's worker processes at
    once, as `bertforge prepare`'s does (`guarded_prepare.stoppable_beam_job`): the runner's
    cleanup joins them, and the pipeline hung at 0 % CPU after a SIGTERM."""
    from bertforge.cluster.commands.guarded_prepare import stoppable_beam_job
    from bertforge.cluster.safety.dataset_guard import refuse_readers, remove_all_but_the_lock
    from bertforge.cluster.safety.run_lock import exclusive_directory
    from bertforge.pipelines.local.work_dir import WORK_DIR_NAME, WorkConflict
    from bertforge.pipelines.prepare import run as run_prepare

    # The dataset's own lock, as `bertforge prepare` takes it, and no reader: a prepare run by
    # hand into this folder, or a train or eval reading it, had its files cleared under it.
    with stoppable_beam_job(config.output), exclusive_directory(config.output, "pipeline"):
        refuse_readers(config.output)
        if os.path.isdir(os.path.join(config.output, WORK_DIR_NAME)):
            # A killed attempt's recorded work: the job continues it, or starts over when it
            # was another job's (the configuration changed since).
            try:
                summary = run_prepare(config, beam_args)
            except WorkConflict:
                summary = run_prepare(config, beam_args, start_over=True)
        else:
            # No manifest, no work record: its files cannot be trusted.
            remove_all_but_the_lock(config.output)
            summary = run_prepare(config, beam_args)
    return {"instances": summary.get("instances"), "seconds_in_beam": summary.get("seconds")}


def shards_complete(config: PrepareConfig, workdir: str,
                    moved: tuple[str, str] | None = None) -> bool:
    """The dataset `config` makes is in config.output (its manifest, written last, and every
    shard it lists: `manifest.finished_dataset`, as `prepare` judges it). One made
    from other input files or another vocabulary (edited or added since) is refused, not
    skipped: the stages after it were trained on it, and rebuilding it alone would leave them
    stale. Input files deleted since are no reason: the shards are all that is left of them.
    `moved`: (from, to), the project folder moved whole since its inputs were read."""
    from bertforge.cluster.safety.dataset_guard import differences_from_dataset
    from bertforge.cluster.safety.run_lock import refuse_if_in_use
    from bertforge.pipelines.contract.manifest import MANIFEST_NAME, finished_dataset
    from bertforge.pipelines.local_job import drop_a_finished_runs_leftovers

    if not os.path.isfile(os.path.join(config.output, MANIFEST_NAME)):
        return False
    refuse_if_in_use(config.output)  # a prepare by hand: its work record below is its own
    differences = differences_from_dataset(config.output, config, inputs_may_be_gone=True,
                                           moved=moved)
    if differences:
        raise ValueError(
            f"{config.output} holds a dataset made from other inputs than the configuration "
            f"reads now (differs in: {'; '.join(differences)}), and the stages after it were "
            f"trained on it; restore the inputs, or make everything again from them in a new "
            f"workdir (or after deleting {workdir})")
    # A stop that landed after the manifest, before the job removed its work record: the job
    # had finished (its manifest is written last), and the record is only disk (GBs).
    drop_a_finished_runs_leftovers(config.output)
    # A shard lost since: the stage makes the dataset again, the same (the job is deterministic).
    return finished_dataset(config.output)


def train_to_the_end(cfg: TrainConfig, launch: LaunchConfig, command: str) -> dict[str, Any]:
    """Training of `cfg` (resume on) on Ray Train with `launch` up to its max_steps: it
    continues from the newest committed checkpoint, or starts fresh (warm-started from
    cfg.init_from); `command` names what to run again when it stops short."""
    from bertforge.cluster.launch.ray_train import train_on_ray

    result = train_on_ray(cfg, launch)
    if result["step"] < cfg.max_steps:
        raise RuntimeError(f"{cfg.run_dir}: training stopped at step {result['step']}, "
                           f"not {cfg.max_steps}; run the {command} again to resume")
    return {"step": result["step"], "checkpoint": result["checkpoint_path"]}


def training_complete(cfg: TrainConfig) -> bool:
    from bertforge.training.checkpoint import committed_steps

    steps = committed_steps(cfg.run_dir)
    return bool(steps) and steps[-1] >= cfg.max_steps


def carried_on(cfg: TrainConfig, later: TrainConfig | None, later_name: str) -> str:
    """Why a phase whose run is gone (its checkpoints deleted to free the disk) needs no
    training: the phase after it, which warm-started from its weights, has checkpoints of its
    own, resumes from those and never reads this one's again ("" where that is not so). It was
    trained anew (a whole phase, days at full size) and then refused as newer than what the
    next phase started from."""
    from bertforge.training.checkpoint import latest_checkpoint

    if (later is None or latest_checkpoint(cfg.run_dir) is not None
            or latest_checkpoint(later.run_dir) is None):
        return ""
    return (f"its run {cfg.run_dir} is gone, and {later_name}, warm-started from its weights, "
            "goes on from checkpoints of its own: skipping")


def export_source(run_dir: str) -> dict[str, Any] | None:
    """The final checkpoint and its commit marker: a retrained checkpoint has a new marker."""
    from bertforge.training.checkpoint import COMMIT_MARKER, latest_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        return None
    with open(os.path.join(path, COMMIT_MARKER), encoding="utf-8") as f:
        return {"checkpoint": path, "committed": json.load(f)}


def export_final(run_dir: str, hf_dir: str) -> dict[str, Any]:
    """The newest checkpoint of `run_dir` as a Hugging Face directory `hf_dir`."""
    from bertforge.training.export import export_checkpoint

    source = export_source(run_dir)
    assert source is not None, "export runs after training committed its final checkpoint"
    tmp = hf_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(source["checkpoint"], tmp)
    shutil.rmtree(hf_dir, ignore_errors=True)
    os.replace(tmp, hf_dir)
    return {"hf_dir": hf_dir, "source": source}


def export_complete(hf_dir: str, run_dir: str, recorded: dict[str, Any] | None) -> bool:
    """The export exists and was made from `run_dir`'s final checkpoint as it is now."""
    from bertforge.training.hf_interop import HF_CONFIG_NAME

    files = (HF_CONFIG_NAME, "model.safetensors")
    if not all(os.path.isfile(os.path.join(hf_dir, name)) for name in files):
        return False
    source, now = (recorded or {}).get("source"), export_source(run_dir)
    if source is None or now is None:
        return False
    # The checkpoint by its name in the run (a project folder moved whole keeps it) and its
    # commit marker (a retrained checkpoint of the same step has another).
    return (os.path.basename(source["checkpoint"]) == os.path.basename(now["checkpoint"])
            and source["committed"] == now["committed"])
