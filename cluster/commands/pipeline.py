"""`bertforge pipeline CONFIG.toml`: the whole chain from one file, safe to run again and again.

    vocab -> prepare-L1 (-> prepare-L2) -> phase1 -> (phase2) -> export

Every stage decides from its outputs whether it is done, not from a record alone, so a deleted
output is rebuilt on the next run (a dataset only while a phase that trains on it is not
done): vocab.txt exists; a shard directory has its manifest.json
(the Beam job writes it last); a run directory has a committed checkpoint at the recipe's
max_steps; the Hugging Face directory exists and was exported from the final checkpoint of the
last phase as it is now. A stage that is not done starts over (vocab, export), continues the
work a killed attempt recorded (prepare, `pipelines.local_job`), or, for training, resumes from
its newest committed checkpoint. A failure anywhere is handled by running
the same command again.

The resolved configuration (the TOML text, its normalized form and the resolved recipes) is
recorded in WORKDIR/pipeline.json; a later run with a configuration that would make different
outputs is refused, naming the keys that differ, and so is one whose input files were added or
changed in size since its shards were made (`stages.shards_complete`). Relative paths in the
file are relative to the file's own directory, so a run does not depend on the current
directory; paths under that directory are compared relative to it, so a project folder moved or
copied whole (file, corpus, workdir) is the same pipeline (`run_pipeline(base_dir=...)`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from bertforge.cluster.commands.stage_runner import Stage, StageRunner
from bertforge.cluster.commands.stages import (
    carried_on,
    export_complete,
    export_final,
    make_vocab,
    prepare_dataset,
    shards_complete,
    train_to_the_end,
    training_complete,
    vocab_change,
    vocab_complete,
)
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.pipelines.contract.config_fields import (
    NOT_IN_FILE,
    REQUIRED,
    RERUN_MAY_CHANGE,
    check_type,
    field_types,
    fields_marked,
    from_table,
    option,
    required_fields,
    same_option,
    table_keys,
    underscore_hint,
)
from bertforge.pipelines.prepare_options import PrepareConfig, check_beam_args
from bertforge.pipelines.vocab_options import VocabConfig
from bertforge.training.config import DERIVED_FROM_MAX_STEPS, TrainConfig

# Keys that say how to run, not what to make: outputs are byte-identical on any Beam runner and
# the training batches the same on any worker count (DESIGN.md, "Determinism"), so changing them
# between runs (prepare locally, train on a cluster) is allowed; so are the [prepare] options
# marked so (rows_per_piece bounds memory and never changes a byte).
HOW_TO_RUN_KEYS = ("config.cluster", "config.prepare.beam_args",
                   *(f"config.prepare.options.{name}"
                     for name in fields_marked(PrepareConfig, RERUN_MAY_CHANGE)))
# Settings an earlier bertforge recorded under another name: [vocab] size, spelled as the flag
# (vocab_size) since; a workdir made before still matches its file.
RENAMED_SETTINGS = {"config.vocab.size": "vocab_size"}
# [phase2] added to a workdir whose phase 1 is done: its settings are new, not other; phase 1's
# outputs stay, phase 2 and its prepare run, and the export is made again from phase 2.
PHASE2_SETTINGS = {"config.phase2": "phase2", "recipes.phase2": "phase2"}


# --- configuration --------------------------------------------------------------------------


def _resolve_path(path: str, base_dir: str) -> str:
    """Relative to the config file's directory; URIs (gs://, s3://) pass through."""
    if "://" in path:
        return path
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def _resolve_input(entry: str, base_dir: str) -> str:
    """Like _resolve_path, keeping a `FORMAT:` prefix (`books:corpus/*.txt`) in front."""
    from bertforge.pipelines.read.readers import split_format

    forced, pattern = split_format(entry)
    resolved = _resolve_path(pattern, base_dir)
    return f"{forced}:{resolved}" if forced else resolved


def _cluster_section(table: Any, base_dir: str) -> LaunchConfig:
    """[cluster]; a relative `storage` is the file's, as every path in it (it was the working
    directory's: checkpoints landed where the command happened to run)."""
    launch = from_table(LaunchConfig, "cluster", table)
    if launch.storage:  # a URI (gs://, s3://) passes as it is
        launch = replace(launch, storage=_resolve_path(launch.storage, base_dir))
    return launch


def _string_list(section: str, key: str, table: dict[str, Any]) -> tuple[str, ...]:
    return check_type(section, key, table.get(key, []), tuple[str, ...])


@dataclass(frozen=True)
class VocabSection:
    """[vocab]: train a WordPiece vocab (`VocabConfig`'s keys; its inputs default to the
    [prepare] inputs), or use an existing file (`path`, e.g. Google's)."""

    path: str | None = option(help="an existing vocab.txt to use (e.g. Google's), instead of "
                              "training one")
    vocab_size: int = same_option(VocabConfig, "vocab_size")
    lower_case: bool = same_option(VocabConfig, "lower_case")
    inputs: tuple[str, ...] = same_option(VocabConfig, "inputs")

    def __post_init__(self) -> None:
        self.vocab_config(("-",), "-")  # its validation, before any stage runs

    def vocab_config(self, default_inputs: tuple[str, ...], output: str) -> VocabConfig:
        return VocabConfig(inputs=self.inputs or default_inputs, output=output,
                           vocab_size=self.vocab_size, lower_case=self.lower_case)

    @classmethod
    def from_table(cls, table: Any, base_dir: str) -> VocabSection:
        if isinstance(table, dict) and "size" in table:
            raise ValueError("vocab.size is spelled vocab_size, as the flag is "
                             "(bertforge vocab --vocab-size)")
        if isinstance(table, dict) and "path" in table and (
                "vocab_size" in table or "inputs" in table):
            raise ValueError("vocab.path uses an existing vocab: give it without "
                             "vocab.vocab_size and vocab.inputs, which train a new one")
        section = from_table(cls, "vocab", table)
        return replace(
            section, path=_resolve_path(section.path, base_dir) if section.path else None,
            inputs=tuple(_resolve_input(p, base_dir) for p in section.inputs),
        )


# A `bertforge prepare` flag a pipeline file gives elsewhere, and where.
_PREPARE_KEYS_SET_ELSEWHERE = {
    "output": "the pipeline writes the shards under workdir",
    "vocab": "give it as [vocab]'s path (or let [vocab] train one)",
    "lower_case": "give it in [vocab]",
    "max_seq_length": "give it in each [phaseN]",
}


@dataclass(frozen=True)
class PrepareSection:
    """[prepare]: the Beam job's `PrepareConfig` fields (one set for both lengths) and the
    flags that go to Beam itself (`beam_args`: runner, workers...)."""

    options: PrepareConfig
    beam_args: tuple[str, ...] = ()

    @classmethod
    def from_table(cls, table: Any, paths: PipelinePaths, vocab: VocabSection,
                   max_seq_length: int, base_dir: str) -> PrepareSection:
        if not isinstance(table, dict):
            raise ValueError(f"[prepare] must be a table, got {table!r}")
        values = dict(table)
        beam_args = _string_list("prepare", "beam_args", values)
        values.pop("beam_args", None)
        inputs = tuple(_resolve_input(p, base_dir) for p in _string_list("prepare", "inputs",
                                                                         values))
        values.pop("inputs", None)
        if not inputs:
            raise ValueError("prepare.inputs is required: a list of corpus files or globs")
        # The fields NOT_IN_FILE come from the pipeline's paths, [vocab] and phase 1.
        options = from_table(
            PrepareConfig, "prepare", values, inputs=inputs,
            output=paths.shards(max_seq_length), vocab=paths.vocab, lower_case=vocab.lower_case,
            max_seq_length=max_seq_length, set_elsewhere=_PREPARE_KEYS_SET_ELSEWHERE,
            also_known=("inputs", "beam_args"),
        )
        try:
            check_beam_args(list(beam_args))
        except ValueError as error:
            raise ValueError(f"prepare.beam_args: {error}") from None
        return cls(options=options, beam_args=beam_args)

    def for_length(self, paths: PipelinePaths, max_seq_length: int) -> PrepareConfig:
        """The job's config for one length (validated again: a phase's length may be bad)."""
        try:
            return replace(self.options, max_seq_length=max_seq_length,
                           output=paths.shards(max_seq_length))
        except ValueError as error:
            raise ValueError(f"prepare for max_seq_length {max_seq_length}: {error}") from None


@dataclass(frozen=True)
class PhaseSection:
    name: str = option(REQUIRED, "phase1 or phase2: the table's name", marks=(NOT_IN_FILE,))
    recipe: str = option(REQUIRED, "a named recipe (training/recipes.py)")
    max_seq_length: int = option(REQUIRED, "the length of the shards this phase trains on")
    overrides: dict[str, Any] = option({}, "TrainConfig fields, over the recipe's (not those "
                                       "NOT_IN_FILE, which the pipeline sets)")

    def __post_init__(self) -> None:
        from bertforge.training.recipes import RECIPES

        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; "
                             f"choose one of {sorted(RECIPES)}")
        known = table_keys(TrainConfig)
        if self.name == "phase2":
            known.discard("init_from")  # phase 2 starts from phase 1's weights
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"overrides: unknown or pipeline-owned key(s) {', '.join(unknown)}"
                f"{underscore_hint(unknown, known)}; allowed: {', '.join(sorted(known))}"
            )
        # Each value as its field's type: `model = "mini"` was a TypeError of dict() in the
        # recipe ("dictionary update sequence element #0 has length 1; 2 is required").
        types = field_types(TrainConfig)
        for key, value in self.overrides.items():
            if value is None:  # a Python caller's "unset" (a file has no null)
                continue
            if isinstance(value, tuple):  # as a Python caller gives a list field
                value = list(value)
            if key == "model" and not isinstance(value, dict):
                raise ValueError(f"overrides.model must be a table of BertConfig fields, e.g. "
                                 f"model = {{ preset = \"{value}\" }}, got {value!r}")
            check_type("overrides", key, value, types[key])

    @classmethod
    def from_table(cls, name: str, table: Any) -> PhaseSection:
        return from_table(cls, name, table, name=name)


# Keyword-only, so that the fields (the file's top-level keys) come in the order a file reads.
@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    workdir: str = option(REQUIRED, "where every stage's outputs go (absolute once resolved)")
    vocab: VocabSection = option(VocabSection(), "[vocab]: train one, or use path's")
    prepare: PrepareSection = option(REQUIRED, "[prepare]: the Beam job's options and beam_args")
    phase1: PhaseSection = option(REQUIRED, "[phase1]: a recipe, its length and overrides")
    phase2: PhaseSection | None = option(help="[phase2]: the same, warm-started from phase 1")
    cluster: LaunchConfig = option(LaunchConfig(), "[cluster]: where training runs")

    def __post_init__(self) -> None:
        if "://" in self.workdir:
            # Locking, atomic renames and DeepSpeed's checkpoints need a (shared) file system.
            raise ValueError(f"workdir must be a local or mounted path, got {self.workdir!r}")
        for phase in self.phases():  # a bad length or recipe override fails now, before any
            self.prepare_config(phase.max_seq_length)  # stage runs
        self.train_configs()

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str) -> PipelineConfig:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown top-level key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        for key in required_fields(cls):
            if key not in data:
                table = field_types(cls)[key] is not str
                raise ValueError(f"{key} is required" + (f" (a [{key}] table)" if table else ""))
        workdir = _resolve_path(check_type("config", "workdir", data["workdir"], str), base_dir)
        paths = PipelinePaths(workdir)
        vocab = VocabSection.from_table(data.get("vocab", {}), base_dir)
        phase1 = PhaseSection.from_table("phase1", data["phase1"])
        return cls(
            workdir=workdir,
            prepare=PrepareSection.from_table(data["prepare"], paths, vocab,
                                              phase1.max_seq_length, base_dir),
            phase1=phase1,
            phase2=PhaseSection.from_table("phase2", data["phase2"]) if "phase2" in data else None,
            vocab=vocab,
            cluster=_cluster_section(data.get("cluster", {}), base_dir),
        )

    def phases(self) -> list[PhaseSection]:
        return [self.phase1] + ([self.phase2] if self.phase2 else [])

    def prepare_config(self, max_seq_length: int) -> PrepareConfig:
        return self.prepare.for_length(PipelinePaths(self.workdir), max_seq_length)

    def train_configs(self) -> dict[str, TrainConfig]:
        """{phase name: TrainConfig}: the named recipe, the overrides, the pipeline's paths."""
        from bertforge.training.recipes import recipe_by_name

        paths = PipelinePaths(self.workdir)
        configs = {}
        for phase in self.phases():
            init_from = paths.run("phase1") if phase.name == "phase2" else None
            overrides = dict(phase.overrides)
            if phase.name == "phase1":
                init_from = overrides.pop("init_from", None)
            try:
                configs[phase.name] = recipe_by_name(
                    phase.recipe, paths.shards(phase.max_seq_length), paths.run(phase.name),
                    init_from=init_from, resume=True, **overrides,
                )
                _check_model(configs[phase.name], phase.max_seq_length, self.vocab.vocab_size)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{phase.name}: {error}") from None
        if "phase2" in configs:
            _check_same_model(configs["phase1"], configs["phase2"], self.vocab.vocab_size)
            _check_phase2_longer(self.phase1, self.phase2, configs["phase2"],
                                 self.vocab.vocab_size)
        return configs

    def settings(self) -> dict[str, Any]:
        """Normalized, JSON-shaped: what pipeline.json records and a later run must match."""
        return {
            "config": asdict(self),
            "recipes": {name: cfg.to_dict() for name, cfg in self.train_configs().items()},
        }


def _check_model(cfg: TrainConfig, max_seq_length: int, vocab_size: int) -> None:
    """The phase's model is buildable and long enough for its shards: found by the phase's
    train before, after the vocabulary and both prepares had run (hours on real data), and a
    corrected file was then refused as "other settings". The data's vocabulary size is not
    known yet: the [vocab] table's stands in (no field checked here depends on it)."""
    from bertforge.training.inputs import check_positions, resolve_model_config

    model = resolve_model_config(cfg.model, vocab_size)
    check_positions(max_seq_length, model, "the phase's dataset")


def _check_same_model(phase1: TrainConfig, phase2: TrainConfig, vocab_size: int) -> None:
    """Phase 2 starts from phase 1's weights: a model of another shape was refused by phase 2's
    train, once phase 1 had trained (and its settings, recorded, pinned the workdir)."""
    from bertforge.training.inputs import resolve_model_config
    from bertforge.training.warm_start import architecture_differences

    differences = architecture_differences(resolve_model_config(phase1.model, vocab_size),
                                           resolve_model_config(phase2.model, vocab_size))
    if differences:
        raise ValueError(f"phase2 warm-starts from phase1's weights, but its model is another "
                         f"(phase1 != phase2: {', '.join(differences)}): give both phases one "
                         "model")


def _check_phase2_longer(phase1: PhaseSection, phase2: PhaseSection, cfg: TrainConfig,
                         vocab_size: int) -> None:
    """A phase-2 recipe trains the positions phase 1 left untrained (`bertforge train`'s
    `inputs.check_phase2_length`, which a pipeline's phase 2 does not pass through): at phase
    1's length or shorter it trained phase 1 again under phase 2's name."""
    from bertforge.training.inputs import resolve_model_config

    positions = resolve_model_config(cfg.model, vocab_size).max_position_embeddings
    if phase2.recipe.endswith("phase2") and \
            phase2.max_seq_length <= phase1.max_seq_length < positions:
        raise ValueError(
            f"phase2: recipe {phase2.recipe} trains at longer sequences than phase 1, and "
            f"max_seq_length {phase2.max_seq_length} is not longer than phase1's "
            f"{phase1.max_seq_length}: give [phase2] max_seq_length = {positions}")


# A phase's settings that say how often it saves and logs, not what it learns: `bertforge train`
# takes them anew on resume (`training.resume_settings`), so a rerun may change them at any time.
CADENCE_KEYS = ("checkpoint_every", "keep_checkpoints", "checkpoint_minutes", "log_every")
# A phase's length of training: free while no later phase started from its weights.
LENGTH_KEYS = ("max_steps", *DERIVED_FROM_MAX_STEPS)
PHASE_NAMES = ("phase1", "phase2")


def settings_free_to_change(config: PipelineConfig) -> tuple[str, ...]:
    """Phase settings no output depends on yet, which a rerun may change: those of a phase
    with no checkpoint, nor any phase after it (a phase that failed at its start is run again
    as corrected), a phase's length of training while no later phase has a checkpoint (it
    resumes to its new max_steps, its warm-up and log cadence following unless given, and
    what comes after it is made again: `bertforge train --resume auto --steps N` likewise),
    every phase's cadence (`CADENCE_KEYS`), and a [phase2] dropped whose run has no
    checkpoint. Phase 1's, under a phase 2 started from its weights, stays fixed."""
    from bertforge.training.checkpoint import committed_steps

    configs = config.train_configs()
    free: list[str] = []
    started_later = False  # a later phase has a checkpoint: it started from this one
    for name in reversed(configs):
        if not started_later:
            free += [f"config.{name}.overrides.max_steps",
                     *(f"recipes.{name}.{key}" for key in LENGTH_KEYS)]
        started_later = started_later or bool(committed_steps(configs[name].run_dir))
        if not started_later:
            free += [f"config.{name}", f"recipes.{name}"]
        free += [f"{table}.{key}" for key in CADENCE_KEYS
                 for table in (f"config.{name}.overrides", f"recipes.{name}")]
    dropped = [name for name in PHASE_NAMES if name not in configs]
    for name in dropped:
        if not committed_steps(PipelinePaths(config.workdir).run(name)):
            free += [f"config.{name}", f"recipes.{name}"]
    return tuple(sorted(free))


def smallest_remedy(config: PipelineConfig, changed: list[str]) -> str:
    """What to delete so that a rerun may make the `changed` settings ("" for the stage
    runner's own remedy, a new workdir): where only phases' settings changed, the runs that
    hold what they made, not the vocabulary and the datasets (hours) with them: the run of
    the first phase changed and of each after it with a checkpoint; only those after it
    where its length alone changed; a [phase2] dropped, its run."""
    from bertforge.training.checkpoint import committed_steps

    if "config.workdir" in changed and all(map(_follows_the_workdir, changed)):
        return _move_it_back(PipelinePaths(config.workdir))
    phases = {key.split(".")[1] for key in changed}
    if not all(key.split(".")[0] in ("config", "recipes") for key in changed) or not (
            phases <= set(PHASE_NAMES)):
        return ""
    paths = PipelinePaths(config.workdir)
    first = min(phases)  # phase1 < phase2
    its_length = (f"config.{first}.overrides.max_steps",
                  *(f"recipes.{first}.{name}" for name in LENGTH_KEYS))
    length_only = all(key in its_length for key in changed if key.split(".")[1] == first)
    later = PHASE_NAMES[PHASE_NAMES.index(first) + (1 if length_only else 0):]
    runs = [paths.run(name) for name in later if committed_steps(paths.run(name))]
    if not runs:
        return ""
    if config.phase2 is None and first == "phase2":
        why = "to drop phase2"
    elif length_only:
        why = (f"to train {first} to its new length ({', '.join(later)} started from its "
               "weights, and starts again from them)")
    else:
        why = f"to train {' and '.join(later)} again as the file says"
    return (f"delete {' and '.join(runs)} {why}: the vocabulary and the datasets are kept "
            "(or use another workdir)")


def as_the_file_names_them(changed: list[str]) -> list[str]:
    """The differing settings (dotted keys of `PipelineConfig.settings`) as the pipeline file
    spells them (`[prepare] num_shards`, `[phase1] overrides.learning_rate`): the refusal
    named `config.prepare.options.num_shards`, and beside a phase's key the resolved recipe
    values it changed (`recipes.phase2.data_dir` for a new `max_seq_length`). Those the
    pipeline sets itself are named only when no key of the file explains them (a recipe that
    another bertforge resolves otherwise)."""
    in_file = [name for name in map(_file_key, changed) if name]
    return list(dict.fromkeys(in_file or map(_pipeline_key, changed)))


def _file_key(dotted: str) -> str | None:
    """`dotted` as a key of the pipeline file, or None for a value the pipeline sets."""
    root, *rest = dotted.split(".")
    if root != "config" or not rest:
        return None
    if len(rest) == 1:
        return rest[0] if rest[0] == "workdir" else f"[{rest[0]}]"
    table, key = rest[0], ".".join(rest[1:])
    if table == "prepare" and rest[1] == "options":
        key = ".".join(rest[2:])
        return f"[prepare] {key}" if key in table_keys(PrepareConfig) else None
    return None if (table in PHASE_NAMES and key == "name") else f"[{table}] {key}"


def _pipeline_key(dotted: str) -> str:
    root, *rest = dotted.split(".")
    if root == "recipes" and len(rest) > 1:
        return f"{rest[0]}'s resolved {'.'.join(rest[1:])}"
    return dotted


# The settings the pipeline derives from its workdir: they differ wherever it does.
_UNDER_THE_WORKDIR = ("config.prepare.options.output", "config.prepare.options.vocab",
                      *(f"recipes.{phase}.{key}" for phase in PHASE_NAMES
                        for key in ("data_dir", "run_dir", "init_from")))


def _follows_the_workdir(key: str) -> bool:
    return key == "config.workdir" or key in _UNDER_THE_WORKDIR


def _move_it_back(paths: PipelinePaths) -> str:
    """A workdir moved (or copied) on its own and named anew in the file: every stage was
    refused as "other settings" with "delete it to start over", its vocabulary, shards and
    checkpoints lost with it. It is the same pipeline where it was made (or moved together
    with the folder of its pipeline file)."""
    try:
        with open(os.path.join(paths.root, "pipeline.json"), encoding="utf-8") as f:
            made_as = json.load(f)["settings"]["config"]["workdir"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (f"it was made as {made_as}: move it back there (a workdir moves only with the "
            "folder of its pipeline file, at the same place in it), or delete it to start over")


def check_phases_can_start(config: PipelineConfig) -> None:
    """What a phase's train would refuse at its start, known now: a global batch the workers'
    micro-batches do not divide, and, for a pipeline that trains on this CPU (no [cluster]
    address or gpu), an engine it cannot run (fp16, say). Before the vocabulary and the
    prepares, whose settings a failure after them pins. A phase that resumes decides its
    precision by its checkpoint (its workers)."""
    from bertforge.training.checkpoint import resumes_a_checkpoint
    from bertforge.training.resolved_engine import check_cpu_engine

    here = not (config.cluster.address or config.cluster.gpu)
    configs = config.train_configs()
    _check_phase2_is_of_phase1_as_it_is(configs)
    for name, cfg in configs.items():
        try:
            if cfg.micro_batch_size is not None:  # else the GPU's memory decides it
                cfg.accumulation_steps(config.cluster.workers)
                _check_the_same_step_batch(name, cfg, config.cluster.workers)
            if here and not resumes_a_checkpoint(cfg.run_dir, cfg.resume):
                check_cpu_engine(cfg.engine())
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None


def _check_phase2_is_of_phase1_as_it_is(configs: dict[str, TrainConfig]) -> None:
    """Phase 2 warm-started from phase 1's weights; a phase 1 trained anew since (its run
    deleted, say) left phase 2 done by its own checkpoints, and the export phase 2's, of the
    old weights. A run's id is the time it started, so the order of the two ids says it (a
    phase 1 resumed keeps its id, and an exact resume its weights)."""
    from bertforge.training.checkpoint import latest_checkpoint, read_metadata

    if "phase2" not in configs:
        return
    newest = [latest_checkpoint(configs[name].run_dir) for name in ("phase1", "phase2")]
    if None in newest:
        return
    phase1_run, phase2_run = (read_metadata(path).get("run_id") for path in newest)
    if phase1_run and phase2_run and phase1_run > phase2_run:
        raise ValueError(
            f"phase1 was trained anew (run {phase1_run}) after phase2 started from its earlier "
            f"weights (run {phase2_run}): phase 2 and the export hold those; move "
            f"{configs['phase2'].run_dir} aside (or delete it) to train phase 2 from phase 1 "
            "as it is now")


def _check_the_same_step_batch(name: str, cfg: TrainConfig, workers: int) -> None:
    """[cluster] workers says how to run, not what: but a recipe without a global_batch_size
    takes its step's batch from the number of workers (micro x accumulation x workers), so a
    phase stopped part-way went on with another batch on other workers, and a different model
    came out (DESIGN: the same batches for any number of workers hold with a global batch)."""
    from bertforge.training.checkpoint import committed_steps, latest_checkpoint, read_metadata

    steps = committed_steps(cfg.run_dir)
    if cfg.global_batch_size is not None or not steps or steps[-1] >= cfg.max_steps:
        return
    started_on = read_metadata(latest_checkpoint(cfg.run_dir)).get("world_size")
    if not isinstance(started_on, int) or started_on == workers:
        return
    per_worker = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    raise ValueError(
        f"its run trained on {started_on} workers ({per_worker * started_on} sequences a step) "
        f"and [cluster] workers = {workers} would go on with {per_worker * workers}: the "
        f"recipe sets no global_batch_size, so the workers set the batch; give workers = "
        f"{started_on} until {name} is done")


def load_config(path: str) -> tuple[PipelineConfig, str]:
    """(validated config, the file's text); relative paths are relative to the file."""
    toml = _toml_module()
    if not os.path.isfile(path):  # not "[Errno 2] No such file or directory: 'p.toml'"
        what = "a directory, not a TOML file" if os.path.isdir(path) else "no such file"
        raise ValueError(f"pipeline file {path}: {what}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = toml.loads(raw.decode("utf-8"))
    except toml.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    return PipelineConfig.from_dict(data, os.path.dirname(os.path.abspath(path))), raw.decode()


def _toml_module():
    """tomllib is in the standard library from Python 3.11; tomli is the same parser before."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("bertforge pipeline reads TOML: it needs Python 3.11+ "
                             "(or `pip install tomli` on 3.10)") from None
    return tomllib


# --- layout ---------------------------------------------------------------------------------


class PipelinePaths:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.vocab_dir = os.path.join(self.root, "vocab")
        self.vocab = os.path.join(self.vocab_dir, "vocab.txt")
        self.hf = os.path.join(self.root, "hf")

    def shards(self, max_seq_length: int) -> str:
        return os.path.join(self.root, f"shards-{max_seq_length}")

    def run(self, phase: str) -> str:
        return os.path.join(self.root, "runs", phase)


# --- stages ---------------------------------------------------------------------------------


def build_stages(
    config: PipelineConfig, paths: PipelinePaths, runner: StageRunner
) -> list[Stage]:
    """vocab, prepare per length, a stage per phase, export (bodies: `cluster.commands.stages`),
    each done when its outputs are."""
    train_configs = config.train_configs()
    names = list(train_configs)
    phases = []
    for index, (name, cfg) in enumerate(train_configs.items()):
        # resume=True: continues from the newest committed checkpoint, or starts fresh (phase 2
        # then warm-starts from phase 1's weights).
        later = names[index + 1] if index + 1 < len(names) else None
        phases.append(Stage(
            name, lambda cfg=cfg: train_to_the_end(cfg, config.cluster, "pipeline"),
            is_done=lambda cfg=cfg, later=later: training_complete(cfg) or carried_on(
                cfg, train_configs.get(later), later)))
    stages = [Stage("vocab", lambda: _make_vocab(config, paths),
                    is_done=lambda: _vocab_done(config, paths, runner))]
    for length in sorted({phase.max_seq_length for phase in config.phases()}):
        readers = [stage for stage, phase in zip(phases, config.phases(), strict=True)
                   if phase.max_seq_length == length]
        stages.append(Stage(
            f"prepare-{length}",
            lambda length=length: prepare_dataset(config.prepare_config(length),
                                                  config.prepare.beam_args),
            is_done=lambda length=length, readers=readers: shards_complete(
                config.prepare_config(length), paths.root,
                runner.moved_since(f"prepare-{length}")) or _read_by_none_to_come(
                    paths.shards(length), readers),
        ))
    last_run = paths.run(names[-1])
    export = Stage("export", lambda: export_final(last_run, paths.hf),
                   is_done=lambda: export_complete(paths.hf, last_run, runner.recorded("export")))
    return stages + phases + [export]


def _read_by_none_to_come(shards: str, readers: list[Stage]) -> str:
    """Why a dataset that is gone (deleted to free the disk) is not made again: every phase
    that trains on it is done, and none would read it (it was made again, the longest stage,
    for nothing); "" while one is not."""
    if not all(reader.is_done() for reader in readers):
        return ""
    done = " and ".join(reader.name for reader in readers)
    return (f"its dataset {shards} is gone, but {done}, which "
            f"{'trains' if len(readers) == 1 else 'train'} on it, "
            f"{'is' if len(readers) == 1 else 'are'} done: not making it again")


def _vocab_config(config: PipelineConfig, paths: PipelinePaths) -> VocabConfig:
    # Without its own inputs: prepare's, as prepare reads them (`books:` is read as books).
    return config.vocab.vocab_config(config.prepare.options.inputs, paths.vocab_dir)


def _make_vocab(config: PipelineConfig, paths: PipelinePaths) -> dict[str, Any]:
    return make_vocab(_vocab_config(config, paths), existing=config.vocab.path)


def _vocab_done(config: PipelineConfig, paths: PipelinePaths, runner: StageRunner) -> bool:
    """vocab.txt is there and is what the configuration makes now (`stages.vocab_change`: an
    edited `[vocab] path`, or trained on inputs that changed since; both were kept without a
    word). One that is not is made again while nothing was made with it; after that it is
    refused: the shards and the training hold the old one, and remaking it alone would leave
    them stale."""
    if not vocab_complete(paths.vocab_dir):
        return False
    change = vocab_change(_vocab_config(config, paths), config.vocab.path,
                          runner.recorded("vocab"), runner.moved_since("vocab"))
    if not change:
        return True
    made = _made_with_the_vocab(config, paths)
    if not made:
        runner.say(f"vocab: {change}, and nothing was made with it yet: making it again")
        return False
    one = len(made) == 1
    named = [os.path.relpath(path, paths.root) for path in made]
    raise ValueError(
        f"{change}, and {paths.root}'s {', '.join(named[:-1])}{' and ' if not one else ''}"
        f"{named[-1]} {'was' if one else 'were'} made with it; restore "
        f"{'it' if config.vocab.path else 'those inputs'}, or delete {'it' if one else 'them'} "
        f"to make {'it' if one else 'them'} again from the new vocabulary")


def _made_with_the_vocab(config: PipelineConfig, paths: PipelinePaths) -> list[str]:
    """The outputs in the workdir made with its vocab.txt: datasets, trained phases, export."""
    from bertforge.pipelines.contract.manifest import MANIFEST_NAME
    from bertforge.training.checkpoint import committed_steps

    lengths = sorted({phase.max_seq_length for phase in config.phases()})
    made = [paths.shards(length) for length in lengths
            if os.path.isfile(os.path.join(paths.shards(length), MANIFEST_NAME))]
    made += [paths.run(phase.name) for phase in config.phases()
             if committed_steps(paths.run(phase.name))]
    return made + ([paths.hf] if os.path.isdir(paths.hf) else [])


# --- the run --------------------------------------------------------------------------------


def run_pipeline(config: PipelineConfig, toml_text: str = "",
                 base_dir: str | None = None) -> dict[str, Any]:
    """Run every stage that is not done; returns {"ran": [...], "skipped": [...], ...}.
    `base_dir`: the pipeline file's folder; paths under it are compared relative to it, so a
    project folder moved or copied whole (file, corpus, workdir) is the same pipeline."""
    paths = PipelinePaths(config.workdir)
    check_phases_can_start(config)
    with StageRunner(paths.root, "pipeline", config.settings(),
                     ignored=HOW_TO_RUN_KEYS + settings_free_to_change(config),
                     remedy=lambda changed: smallest_remedy(config, changed),
                     key_names=as_the_file_names_them,
                     renamed=RENAMED_SETTINGS, may_add=PHASE2_SETTINGS,
                     dir_flag="workdir", base_dir=base_dir) as runner:
        runner.state["toml"] = toml_text or runner.state.get("toml", "")
        runner.save()
        outcome = runner.run(build_stages(config, paths, runner))
        runner.say(f"done: Hugging Face export in {paths.hf}")
    return {"workdir": paths.root, "hf_dir": paths.hf, **outcome}
