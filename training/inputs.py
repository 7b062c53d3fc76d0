"""Checks of a run's inputs that need no engine: what the driver runs before Ray starts.

A wrong --data, a damaged dataset, a run directory that cannot be written or a resume with
another architecture would otherwise be found inside the Ray workers, minutes later, and be
retried as if a node had died. Each check reads metadata only (the manifest, parsed once,
Arrow footers through a memory map, the vocabulary, a checkpoint's bertforge.json), so a whole
pre-flight takes seconds even for a large dataset, and each failure is one `UserInputError`
line naming the file or flag. `check_train_inputs`, `check_eval_inputs` and
`check_export_inputs` are what `train`, `eval` and `export` run; `finetune --model` runs
`check_model_source`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from bertforge.pipelines.contract.manifest import is_bertforge_dataset, sha256_file
from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.data.split import read_dataset_manifest, read_vocab_tokens, split_rows
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.errors import MissingInputError, UserInputError, as_user_error
from bertforge.training.hf_interop import is_empty_directory
from bertforge.training.metrics import counted
from bertforge.training.model import BertConfig
from bertforge.training.warm_start import (
    check_casing,
    check_fits,
    check_resume_architecture,
    hf_source_metadata,
    source_positions,
)

# Pseudo filesystems: a directory there can look creatable and writable and still not hold files.
_REFUSED_ROOTS = ("/proc", "/sys", "/dev")


def check_dataset(data_dir: str, splits: tuple[str, ...] = ("train",)) -> DatasetFacts:
    """The dataset's facts once its manifest parses, names `splits`, every shard it lists
    exists with its row count, and vocab.txt matches the manifest's hash and size; no split
    it reads is empty."""
    if "://" in data_dir:
        facts = _check_remote_dataset(data_dir, splits)
    else:
        facts = _check_local_dataset(data_dir, splits)
    refuse_empty_splits(facts, splits, data_dir)
    return facts


def _check_local_dataset(data_dir: str, splits: tuple[str, ...]) -> DatasetFacts:
    if not os.path.exists(data_dir):
        raise MissingInputError(f"dataset {data_dir} does not exist")
    if not os.path.isdir(data_dir):
        raise UserInputError(f"dataset {data_dir} is a file, not a prepared dataset directory")
    manifest = read_dataset_manifest(data_dir)  # the one parse (user errors name the file)
    try:
        facts = DatasetFacts.from_manifest(manifest, data_dir)
    except ValueError as error:
        raise as_user_error(error) from error
    for split in splits:
        split_rows(data_dir, manifest, split)  # footers and row counts only, memory-mapped
    read_vocab_tokens(data_dir, manifest.tokenizer)
    return facts


def refuse_empty_splits(facts: DatasetFacts, splits: tuple[str, ...], data_dir: str) -> None:
    """A split the command reads that holds nothing is said as such (it was "fewer than one
    optimizer step: give a smaller --batch-size", which no batch size mends)."""
    empty = next((split for split in splits if facts.split_sizes.get(split) == 0), None)
    if empty is None:
        return
    why = ("prepare holds whole documents out for it (--validation-fraction), and this corpus "
           "had too few; prepare with more documents, or train without --eval-every (eval: "
           "--split train)") if empty == "validation" else "prepare with more text"
    raise UserInputError(f"split {empty!r} of {data_dir} is empty (0 instances): {why}")


def _check_remote_dataset(data_dir: str, splits: tuple[str, ...]) -> DatasetFacts:
    """A gs:// or s3:// dataset: its manifest parses and names `splits` (the shards are
    checked once copied)."""
    import json

    from bertforge.pipelines.contract.manifest import MANIFEST_NAME, Manifest
    from bertforge.training.object_storage import (
        CHECK_RETRY_SECONDS,
        checking_filesystem_of,
        storage_error,
    )

    path = f"{data_dir} ({MANIFEST_NAME})"
    try:
        filesystem, root = checking_filesystem_of(data_dir)  # the URI's query stays its own
        with filesystem.open_input_stream(f"{root.rstrip('/')}/{MANIFEST_NAME}") as stream:
            text = stream.read()
    except FileNotFoundError as error:
        raise MissingInputError(f"no dataset at {data_dir}: it has no {MANIFEST_NAME}; give "
                                "the --output of a finished prepare") from error
    except (OSError, ValueError) as error:  # out of reach (credentials, network); a bad URI
        retried = (f" (within {CHECK_RETRY_SECONDS:.0f} s of retries)"
                   if data_dir.startswith("gs://") else "")
        raise UserInputError(f"{path} could not be read{retried}: "
                             f"{storage_error(error)}") from error
    try:
        manifest = Manifest.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as error:
        raise UserInputError(
            f"{path} could not be read as a bertforge manifest ({error})") from error
    absent = [split for split in splits if split not in manifest.splits]
    if absent:
        raise UserInputError(f"dataset {data_dir} has no {' or '.join(absent)} split (it has "
                             f"{', '.join(sorted(manifest.splits))})")
    return DatasetFacts.from_manifest(manifest, data_dir)


def check_run_dir(run_dir: str, what: str = "run directory") -> str:
    """`run_dir`, absolute, once it exists (created if need be) and a file can be written in it.
    `what` names it in the errors (an export's checks its output's parent here)."""
    refuse_run_dir_uri(run_dir)
    path = os.path.abspath(run_dir)
    root = next((r for r in _REFUSED_ROOTS if path == r or path.startswith(r + os.sep)), None)
    if root is not None:
        raise UserInputError(f"{what} {run_dir} is under {root}, a pseudo filesystem; "
                             "give a directory on a real disk")
    # The nearest existing folder above: a file there (afile/hf/...) cannot hold a directory.
    above = path
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UserInputError(f"{what} {run_dir} is a file, not a directory" if above == path
                             else f"{what} {run_dir}: {above} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        raise UserInputError(
            f"{what} {run_dir} cannot be created or written ({error.strerror or error})"
        ) from error
    return path


def refuse_run_dir_in_a_dataset(run_dir: str) -> None:
    """A run's checkpoints, logs and Ray folder written among a dataset's shards (`--run-dir
    shards/run`, or the dataset's own folder): `prepare --overwrite` there, or deleting the
    dataset, would take the run with it."""
    folder = os.path.abspath(run_dir)
    while True:
        if is_bertforge_dataset(folder):
            where = "is" if folder == os.path.abspath(run_dir) else f"is inside {folder},"
            raise UserInputError(f"--run-dir {run_dir} {where} a prepared dataset; give a "
                                 "folder of its own (beside the dataset, not in it)")
        if os.path.dirname(folder) == folder:
            return
        folder = os.path.dirname(folder)


def refuse_run_dir_uri(run_dir: str) -> None:
    """A run directory is local or mounted: a URI would become a local folder named `gs:`, or
    the run lock's object in a bucket named like the run."""
    if "://" in run_dir:
        raise UserInputError(
            f"run directory {run_dir} is a URI; --run-dir is a local or mounted path, and "
            "--storage gs://... (or s3://...) keeps the run's checkpoints in object storage")


def check_resume(run_dir: str, model_config: BertConfig, facts: DatasetFacts,
                 data_dir: str) -> tuple[str, dict] | None:
    """The checkpoint a resume of `run_dir` would load and its metadata (None: a fresh start),
    once its architecture, vocabulary and casing are those of the requested model and data."""
    latest = checkpoint.latest_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    if latest is None:
        return None
    saved = read_checkpoint_metadata(latest)
    check_resume_architecture(saved, model_config, latest, facts, data_dir)
    verify_checkpoint(latest, saved)
    return latest, saved


def verify_checkpoint(path: str, metadata: dict | None = None) -> None:
    """What a load would find wrong with a complete checkpoint, found from the driver in
    seconds: a .pt file that is truncated, not torch's zip format, or holds objects outside
    the types a checkpoint may contain (checked with the restricted unpickler, so nothing in it
    runs), or a bertforge.json whose model_config disagrees with the weights' shapes."""
    try:
        checkpoint.verify_safe_to_unpickle(path)
        checkpoint.check_weights_match_config(path, metadata)
    except (OSError, ValueError) as error:
        raise as_user_error(error) from error


def read_checkpoint_metadata(path: str) -> dict:
    """A complete checkpoint's bertforge.json, as a user error when it cannot be read."""
    try:
        return checkpoint.read_metadata(path)
    except (OSError, ValueError) as error:
        raise as_user_error(error) from error


# What every bertforge has written into a checkpoint's bertforge.json, and loads rely on.
REQUIRED_METADATA = ("model_config", "vocab_sha256", "lower_case", "global_step")


def check_checkpoint(path: str,
                     also: Callable[[str, dict[str, Any]], None] | None = None) -> str:
    """The complete checkpoint `path` names (itself, or a run directory's newest), readable,
    safe to unpickle and holding weights of its bertforge.json's shapes (`verify_checkpoint`);
    `also(checkpoint, its bertforge.json)` checks more. A run's newest that a running train
    removes meanwhile: its next newest is checked."""
    refuse_storage_uri(path, "a checkpoint")
    if not os.path.exists(path):
        pruned = checkpoint.pruned_checkpoint(path)  # a running train removed it
        raise MissingInputError(pruned or f"checkpoint {path} does not exist")
    try:
        resolved, _ = checkpoint.read_newest(
            path, lambda resolved: _check_complete_checkpoint(resolved, also))
    except ValueError as error:
        raise as_user_error(error) from error
    return resolved


def _check_complete_checkpoint(
        resolved: str, also: Callable[[str, dict[str, Any]], None] | None) -> None:
    saved = read_checkpoint_metadata(resolved)
    if not os.path.exists(os.path.join(resolved, "vocab.txt")):
        raise MissingInputError(f"checkpoint {resolved} lacks its vocab.txt")
    lacking = [key for key in REQUIRED_METADATA if key not in saved]
    if lacking:  # export, eval and warm starts read each of them
        raise UserInputError(f"{os.path.join(resolved, checkpoint.METADATA_NAME)} lacks "
                             f"{', '.join(lacking)}: not a bertforge checkpoint's, or edited")
    check_checkpoint_vocab(resolved, saved)
    missing = checkpoint.missing_rank_files(resolved, saved)
    if missing:
        raise MissingInputError(
            f"checkpoint {resolved} lacks the optimizer files of rank(s) "
            f"{', '.join(map(str, missing))} of its {saved['world_size']}, which hold part of "
            "its weights (nodes that each kept their own run directory: the whole checkpoint "
            "is in the run's --storage; copy it here)")
    verify_checkpoint(resolved, saved)
    if also is not None:
        also(resolved, saved)


def check_checkpoint_vocab(resolved: str, saved: dict[str, Any]) -> None:
    """The checkpoint's vocab.txt is the one its weights were trained with (its bertforge.json's
    vocab_sha256): export ships it as the model's tokenizer and finetune tokenizes with it, so
    another one of the same size (a copy from another run, an edit) gave every word other ids
    and was taken silently."""
    path = os.path.join(resolved, "vocab.txt")
    expected = saved["vocab_sha256"]
    digest = sha256_file(path)  # a few hundred KB: milliseconds
    if isinstance(expected, str) and digest != expected:
        raise UserInputError(
            f"{path} is not the vocabulary this checkpoint was trained with (sha256 "
            f"{digest[:12]}..., its {checkpoint.METADATA_NAME} says {expected[:12]}...): copy "
            "back the vocab.txt of the dataset it was trained on")


def check_model_source(source: str, flag: str = "model") -> str:
    """A warm-start or fine-tuning source: a complete checkpoint, a run directory with one
    (returns the checkpoint), or a Hugging Face directory with config.json and weights. `flag`
    names the source in a refusal: the option that gave it (train's --init-from)."""
    from bertforge.training.hf_interop import HF_CONFIG_NAME, HF_WEIGHTS_NAMES

    refuse_storage_uri(source, "a model")
    if os.path.isfile(source):
        raise UserInputError(f"{flag} {source}: a file, not a directory (a checkpoint, a run "
                             "directory or a Hugging Face model's directory)")
    if not os.path.isdir(source):
        raise MissingInputError(f"{flag} {source}: no such directory")
    if checkpoint.holds_checkpoint(source):
        return check_checkpoint(source)
    if checkpoint.run_marks(source):  # its config.json is the run's recipe, not a model's
        raise UserInputError(checkpoint.no_checkpoint_yet(source, flag))
    if is_hf_model_dir(source):
        return source
    raise UserInputError(
        f"{flag} {source} is neither a complete checkpoint, a run directory with one, nor a "
        f"Hugging Face directory ({HF_CONFIG_NAME} + {HF_WEIGHTS_NAMES[0]})")


def is_hf_model_dir(path: str) -> bool:
    """A Hugging Face model's directory (config.json and weights) that holds no checkpoint (a
    run directory has a config.json too)."""
    from bertforge.training.hf_interop import HF_CONFIG_NAME, hf_weights_file

    return (os.path.isdir(path) and not checkpoint.holds_checkpoint(path)
            and os.path.exists(os.path.join(path, HF_CONFIG_NAME))
            and hf_weights_file(path) is not None)


def refuse_storage_uri(path: str, what: str) -> None:
    """Checkpoints and exports are read and written on a local (or mounted) filesystem; a URI
    would otherwise become a local folder named `gs:` in the current directory."""
    if "://" in path:
        raise UserInputError(
            f"{path}: {what} in object storage is not read or written here; copy it to or "
            "from a local directory (gcloud storage cp -r, aws s3 cp --recursive)")


def check_output_dir(output: str) -> str:
    """An export's output: a new (or empty) directory in a parent that can be created and
    written."""
    refuse_storage_uri(output, "an export")
    if not output.strip():  # it said "output  exists" of the working directory
        raise UserInputError("--output is empty: give the directory to export to")
    path = os.path.abspath(output)
    if os.path.exists(path) and not is_empty_directory(path):
        raise UserInputError(f"output {output} exists{_export_held(path)}; give a new directory "
                             "(an export never writes over one)")
    check_run_dir(os.path.dirname(path), f"--output {output}: its folder")
    return path


def _export_held(path: str) -> str:
    """', holding the export of run R, step N' where `path` is an export: whether it is the
    one wanted is then plain (a rerun of the same export is done without a word)."""
    from bertforge.training.export import exported_source

    try:
        source = exported_source(path)
        return f", holding the export of run {source['run_id']}, step {source['global_step']}"
    except (OSError, ValueError, KeyError, TypeError):  # no export, or not one of ours
        return ""


def resolve_model_config(model: dict[str, Any], vocab_size: int) -> BertConfig:
    """`{"preset": "tiny", ...overrides}` or explicit fields; vocab_size always from the data."""
    fields = dict(model)
    preset = fields.pop("preset", None)
    if preset is not None:
        base = BertConfig.preset(preset, vocab_size=vocab_size).to_dict()
        base.update(fields)
        fields = base
    fields["vocab_size"] = vocab_size
    return BertConfig.from_dict(fields)


def hf_lower_case(hf_dir: str) -> bool | None:
    """Whether a Hugging Face directory's tokenizer lower-cases (its tokenizer_config.json,
    else its tokenizer.json); None when neither says (nothing to compare)."""
    from bertforge.training import hf_interop

    return hf_interop.hf_lower_case(hf_dir)


def check_positions(max_seq_length: int, model_config: BertConfig, data_dir: str,
                    model: str = "the model") -> None:
    """Phase 2 data (512 tokens) needs a model with at least 512 position embeddings. What to
    do is said for either side: a checkpoint's or a warm start's positions are what they are."""
    positions = model_config.max_position_embeddings
    if max_seq_length > positions:
        raise ValueError(
            f"{data_dir} holds sequences of up to {max_seq_length} tokens, but {model} has "
            f"max_position_embeddings={positions}: give data prepared at --max-seq-length "
            f"{positions} or less, or a model with more positions (BERT uses 512 in both "
            "phases)"
        )


def check_phase2_length(recipe: str | None, cfg: TrainConfig) -> None:
    """A phase-2 recipe trains the positions its warm start has not trained yet (Google's and
    NVIDIA's phase 2: 512 tokens after 128). On data no longer than its source was trained at
    it trained phase 1 again under phase 2's name, without a word (`--data` given phase 1's
    shards). Refused for a new run whose source has untrained positions; a source that trained
    all of them (Google's BERT) may go on at any length. What cannot be read is left to the
    pre-flight, which says what it is."""
    if not (recipe or "").endswith("phase2") or not cfg.init_from or "://" in cfg.data_dir:
        return
    if checkpoint.resumes_a_checkpoint(cfg.run_dir, cfg.resume):
        return  # a resume reads no --init-from
    try:
        length = DatasetFacts.read(cfg.data_dir).max_seq_length
        positions = source_positions(cfg.init_from)
    except (OSError, ValueError):
        return
    if positions is None:
        return
    trained, available = positions
    if length <= trained < available:
        raise UserInputError(
            f"--recipe {recipe} trains phase 2 at longer sequences than phase 1, but "
            f"{cfg.data_dir} holds sequences of up to {length} tokens and --init-from "
            f"{cfg.init_from} was trained at {trained} already (of its {available} positions): "
            f"give phase 2 a dataset prepared with --max-seq-length {available}")


def check_train_inputs(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Everything `train` can know before its workers start: data, run directory, the model
    against the data's lengths, a resume against the requested architecture (and against the
    precision and ZeRO stage given), --init-from, and, on `world_size` workers, the step's
    batch against them and the training split where the micro-batch is known."""
    facts = check_dataset(cfg.data_dir, ("train", "validation") if cfg.eval_every else ("train",))
    refuse_run_dir_in_a_dataset(cfg.run_dir)
    made = not os.path.isdir(cfg.run_dir)
    check_run_dir(cfg.run_dir)
    try:
        _check_train_run(cfg, facts, world_size)
    except BaseException:
        if made:  # a refused run leaves no directory it made (still empty)
            with contextlib.suppress(OSError):
                os.rmdir(cfg.run_dir)
        raise


def _check_train_run(cfg: TrainConfig, facts: DatasetFacts, world_size: int | None) -> None:
    """`check_train_inputs` once the data and the run directory are known to be usable."""
    model_config = resolve_model_config(cfg.model, facts.vocab_size)
    check_positions(facts.max_seq_length, model_config, cfg.data_dir)
    resumed = check_resume(cfg.run_dir, model_config, facts, cfg.data_dir) if cfg.resume else None
    if resumed is not None:
        path, saved = resumed
        if cfg.precision != "auto":  # "auto" keeps the checkpoint's
            check_precision_change(saved, cfg, path)
        if cfg.zero_stage is not None and world_size is not None:  # None: the device decides
            check_zero_stage_change(saved, cfg.zero_stage, world_size, path)
        check_same_course(saved, cfg, facts, path)
    if resumed is None and cfg.init_from:
        source = check_model_source(cfg.init_from, "--init-from")
        # A checkpoint's bertforge.json says it all; a Hugging Face directory's config.json and
        # vocabulary its model (the worker reads its weights), its tokenizer files its casing
        # (when they say it).
        if os.path.exists(os.path.join(source, checkpoint.COMMIT_MARKER)):
            saved = read_checkpoint_metadata(source)
            check_fits(cfg.init_from, checkpoint.model_config_of(source, saved),
                       saved.get("vocab_sha256"), model_config, facts.vocab_sha256)
        else:
            config, vocab_sha256 = hf_source_metadata(source)
            check_fits(cfg.init_from, config, vocab_sha256, model_config, facts.vocab_sha256)
            saved = {"lower_case": hf_lower_case(source)}
        check_casing(saved, facts, f"init_from {cfg.init_from}", cfg.data_dir)
    if world_size is not None:
        check_step_batch(cfg, facts, world_size)


def check_step_batch(cfg: TrainConfig, facts: DatasetFacts, world_size: int) -> None:
    """The global batch divides among the workers and the training split fills one step, where
    the micro-batch is known (a full-size recipe leaves it to the GPU: the worker checks it)."""
    if cfg.micro_batch_size is None:
        return
    accumulation = cfg.accumulation_steps(world_size)  # not a divisor: its own error
    step = cfg.micro_batch_size * world_size * accumulation
    rows = facts.split_sizes.get("train", 0)
    if rows < step:
        raise UserInputError(
            f"the training split of {cfg.data_dir} has {rows} sequences, fewer than one "
            f"optimizer step ({cfg.micro_batch_size} micro x {counted(world_size, 'worker')} x "
            f"{accumulation} accumulation = {step}): give a smaller --batch-size or "
            "--global-batch-size, or prepare more data")


def check_same_course(saved: dict[str, Any], cfg: TrainConfig, facts: DatasetFacts,
                      path: str) -> None:
    """A resume continues the same data order and optimizer: the loader's saved position
    counts samples of an order that the seed and the training split's size make, and the
    optimizer's state is the saved optimizer's. (Found by the workers before, once Ray had
    started, and retried: `cannot resume: the saved loader state has num_samples=489`, a
    KeyError of LAMB's.) Keys a checkpoint of an earlier bertforge lacks are not compared."""
    restart = f"or start a new run with --init-from {path} to continue its weights"
    if saved.get("seed") not in (None, cfg.seed):
        raise UserInputError(f"{path} was trained with --seed {saved['seed']}; a resume keeps "
                             f"the data order it made: give --seed {saved['seed']}, {restart}")
    trained_on = saved.get("train_samples")
    if trained_on not in (None, facts.split_sizes.get("train", trained_on)):
        raise UserInputError(
            f"{path} was trained on a dataset of {trained_on:,} training samples "
            f"({saved.get('data_dir', 'its --data')}); {cfg.data_dir} has "
            f"{facts.split_sizes['train']:,}, and the run's position in its data order would "
            f"point at other samples: resume on the run's own dataset, {restart}")
    trained_order = saved.get("train_sha256")
    if trained_order not in (None, facts.train_sha256):
        raise UserInputError(
            f"{path} was trained on other samples than the training split of {cfg.data_dir} "
            f"holds (the same number, {facts.split_sizes['train']:,}, but other shards: a "
            "dataset prepared again from other text or with other settings), and the run's "
            "position in its data order would point at them: resume on the run's own dataset "
            f"({saved.get('data_dir', 'its --data')}), {restart}")
    if saved.get("optimizer") not in (None, cfg.optimizer):
        raise UserInputError(
            f"{path} was trained with --optimizer {saved['optimizer']}, whose state it holds; "
            f"resuming it with {cfg.optimizer} is not supported: give --optimizer "
            f"{saved['optimizer']}, {restart}")


def check_precision_change(saved: dict[str, Any], cfg: TrainConfig, path: str) -> None:
    """A resume continues in the precision its checkpoint was trained in ("auto" keeps it).

    DeepSpeed lays the optimizer state out per precision (bf16 at ZeRO >= 1 writes its
    BF16_Optimizer's files), so another one cannot load it.
    """
    saved_precision = saved.get("precision")  # None: saved before precisions were recorded
    if (saved_precision == cfg.precision == "bf16" and saved.get("zero_stage") == 0
            and cfg.zero_stage in (None, 0) and saved.get("bf16_weights", True)):
        raise UserInputError(
            f"{path} was trained in bf16 at ZeRO stage 0 by an earlier bertforge, which kept "
            "bf16 weights and DeepSpeed's bf16 optimizer state; stage 0 now keeps fp32 weights "
            f"under torch.autocast and cannot load that state: start a new run with "
            f"--init-from {path} to continue its weights"
        )
    if saved_precision not in (None, cfg.precision):
        raise UserInputError(
            f"{path} was trained in {saved_precision}; resuming it in {cfg.precision} is not "
            f"supported: give --precision {saved_precision} or auto (which keeps it), or start "
            f"a new run with --init-from {path} to continue its weights in {cfg.precision}"
        )


def check_zero_stage_change(saved: dict[str, Any], zero_stage: int, world_size: int,
                            path: str) -> None:
    """A resume stays at stage 0 or stays at stages 1-3: stage 0 keeps whole fp32 states,
    stages 1-3 DeepSpeed's sharded ones, and neither loads the other's (on the same number of
    workers too: DeepSpeed's own errors are a missing bf16_zero_pp_rank file or a NoneType)."""
    saved_world, saved_stage = saved.get("world_size"), saved.get("zero_stage")
    if saved_stage is None or (saved_stage == 0) == (zero_stage == 0):
        return
    raise UserInputError(
        f"{path} was saved by {counted(saved_world, 'worker')} under ZeRO stage {saved_stage}; "
        f"resuming on {counted(world_size, 'worker')} under ZeRO stage {zero_stage} is not "
        "supported: keep zero_stage 0 in both runs, or ZeRO >= 1 in both (converted to a "
        "universal checkpoint)"
    )


def check_eval_inputs(checkpoint_path: str, data_dir: str, split: str,
                      device: str = "cpu") -> None:
    """`eval`: the checkpoint (or Hugging Face directory) resolves, the dataset's split opens
    with the same vocabulary and casing, and lengths the model has positions for, and the
    device asked for is there."""
    facts = check_dataset(data_dir, (split,))

    def fits_the_data(resolved: str, saved: dict[str, Any],
                      model_config: BertConfig | None = None) -> None:
        what = f"checkpoint {resolved}" if model_config is None else f"model {resolved}"
        if saved.get("vocab_sha256") != facts.vocab_sha256:
            raise UserInputError(
                f"{data_dir} uses another vocabulary than {what}: eval scores a model on text "
                "prepared with its own vocabulary (`bertforge prepare --vocab` its vocab.txt), "
                "or give the dataset of the run that trained it")
        check_casing(saved, facts, what, data_dir)
        check_positions(facts.max_seq_length,
                        model_config or checkpoint.model_config_of(resolved, saved),
                        data_dir, what)

    if is_hf_model_dir(checkpoint_path):
        config, vocab_sha256 = hf_source_metadata(checkpoint_path)
        if vocab_sha256 is None:
            raise UserInputError(f"model {checkpoint_path} has no vocab.txt or tokenizer.json: "
                                 f"its vocabulary cannot be checked against {data_dir}'s")
        fits_the_data(checkpoint_path, {"vocab_sha256": vocab_sha256,
                                        "lower_case": hf_lower_case(checkpoint_path)}, config)
    else:
        check_checkpoint(checkpoint_path, also=fits_the_data)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserInputError("--device cuda: torch sees no GPU here (use --device auto or "
                                 "cpu)")


def check_export_inputs(checkpoint_path: str, output: str) -> None:
    """`export`: the checkpoint resolves and the output directory can be written."""
    if is_hf_model_dir(checkpoint_path):  # it was "neither a complete checkpoint nor a run"
        raise UserInputError(f"{checkpoint_path} is a Hugging Face model directory already: "
                             "export reads a bertforge checkpoint or run directory (finetune "
                             "and eval take this directory as it is)")
    check_checkpoint(checkpoint_path)
    check_output_dir(output)
