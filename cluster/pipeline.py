"""`bertforge pipeline CONFIG.toml`: the whole chain from one file, safe to run again and again.

    vocab -> prepare-L1 (-> prepare-L2) -> phase1 -> (phase2) -> export

Every stage decides from its outputs whether it is done, not from a record alone, so a deleted
output is rebuilt on the next run: vocab.txt exists; a shard directory has its manifest.json
(the Beam job writes it last); a run directory has a committed checkpoint at the recipe's
max_steps; the Hugging Face directory exists and was exported from the final checkpoint of the
last phase as it is now. A stage that is not done starts over (vocab, prepare, export) or, for
training, resumes from its newest committed checkpoint. A failure anywhere is handled by running
the same command again.

The resolved configuration (the TOML text, its normalized form and the resolved recipes) is
recorded in WORKDIR/pipeline.json; a later run with a configuration that would make different
outputs is refused, naming the keys that differ. Relative paths in the file are relative to the
file's own directory, so a run does not depend on the current directory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bertforge.cluster.stage_runner import (
    LOCK_NAME,
    exclusive_directory,
    fresh_dir,
    heartbeat,
    write_json_atomic,
)

STATE_NAME = "pipeline.json"
STATE_VERSION = 1

# Keys that say how to run, not what to make: outputs are byte-identical on any Beam runner and
# the training batches the same on any worker count (DESIGN: determinism), so changing them
# between runs (prepare locally, train on a cluster) is allowed.
HOW_TO_RUN_KEYS = ("cluster", "prepare.beam_args")

# Flags the pipeline sets itself from the config; giving them in beam_args would contradict it.
_OWNED_PREPARE_FLAGS = (
    "--input", "--output", "--vocab", "--lower_case", "--max_seq_length", "--short_seq_prob",
    "--dupe_factor", "--seed", "--validation_fraction", "--num_shards", "--num_validation_shards",
    "--random_pool_size",
)
# TrainConfig fields the pipeline owns: where data and runs live, and resuming (always on).
_OWNED_TRAIN_FIELDS = ("data_dir", "run_dir", "resume")


# --- configuration --------------------------------------------------------------------------


def _check_type(section: str, key: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """TOML gives typed values; a wrong type is a user error named by its dotted key."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python, but `workers = true` is a mistake, not 1 worker.
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{section}.{key} must be {names}, got {value!r}")


def _check_at_least(section: str, key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{section}.{key} must be at least {minimum}, got {value}")


def _check_keys(section: str, table: Any, cls: type) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"[{section}] must be a table, got {table!r}")
    known = {f.name for f in fields(cls)} - {"name"}  # a phase's name is its table's
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) in [{section}]: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )


def _resolve_path(path: str, base_dir: str) -> str:
    """Relative to the config file's directory; URIs (gs://, s3://) pass through."""
    if "://" in path:
        return path
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def _resolve_input(entry: str, base_dir: str) -> str:
    """Like _resolve_path, keeping a `FORMAT:` prefix (`books:corpus/*.txt`) in front."""
    from bertforge.pipelines.readers import split_format

    forced, pattern = split_format(entry)
    resolved = _resolve_path(pattern, base_dir)
    return f"{forced}:{resolved}" if forced else resolved


@dataclass(frozen=True)
class VocabSection:
    """Train a WordPiece vocab (`size`), or use an existing file (`path`, e.g. Google's)."""

    path: str | None = None
    size: int = 30522
    lower_case: bool = True
    # Files to train on; default: the [prepare] inputs (read as text, format prefixes dropped).
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.path is not None:
            _check_type("vocab", "path", self.path, str)
        _check_type("vocab", "size", self.size, int)
        _check_type("vocab", "lower_case", self.lower_case, bool)
        _check_at_least("vocab", "size", self.size, 6)  # the 5 special tokens and one more

    @classmethod
    def from_table(cls, table: dict[str, Any], base_dir: str) -> VocabSection:
        _check_keys("vocab", table, cls)
        if "path" in table and ("size" in table or "inputs" in table):
            raise ValueError("vocab.path uses an existing vocab: give it without vocab.size "
                             "and vocab.inputs, which train a new one")
        inputs = table.get("inputs", [])
        _check_type("vocab", "inputs", inputs, list)
        path = table.get("path")
        return cls(
            path=_resolve_path(path, base_dir) if isinstance(path, str) else path,
            size=table.get("size", cls.size), lower_case=table.get("lower_case", cls.lower_case),
            inputs=tuple(_resolve_input(_str_item("vocab", "inputs", p), base_dir) for p in inputs),
        )


def _str_item(section: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{section}.{key} must be a list of strings, got item {value!r}")
    return value


@dataclass(frozen=True)
class PrepareSection:
    """The Beam job's shared options; max_seq_length comes from each phase."""

    inputs: tuple[str, ...]
    beam_args: tuple[str, ...] = ()
    num_shards: int = 4
    num_validation_shards: int = 0  # 0: max(1, num_shards // 10)
    dupe_factor: int = 1
    seed: int = 12345
    short_seq_prob: float = 0.1
    validation_fraction: float = 0.05
    random_pool_size: int = 512

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("prepare.inputs is required: a list of corpus files or globs")
        for key in ("num_shards", "dupe_factor", "random_pool_size", "num_validation_shards",
                    "seed"):
            _check_type("prepare", key, getattr(self, key), int)
        for key in ("num_shards", "dupe_factor", "random_pool_size"):
            _check_at_least("prepare", key, getattr(self, key), 1)
        _check_at_least("prepare", "num_validation_shards", self.num_validation_shards, 0)
        for key in ("short_seq_prob", "validation_fraction"):
            _check_type("prepare", key, getattr(self, key), (int, float))
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"prepare.short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(
                f"prepare.validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        self._check_beam_args()

    def _check_beam_args(self) -> None:
        from bertforge.pipelines.prepare_options import check_argv

        owned = [a for a in self.beam_args if a.split("=", 1)[0] in _OWNED_PREPARE_FLAGS]
        if owned:
            raise ValueError(f"prepare.beam_args must not set {', '.join(owned)}: the pipeline "
                             "sets it from the configuration")
        try:
            check_argv(list(self.beam_args))
        except ValueError as error:
            raise ValueError(f"prepare.beam_args: {error}") from None

    @classmethod
    def from_table(cls, table: dict[str, Any], base_dir: str) -> PrepareSection:
        _check_keys("prepare", table, cls)
        values = dict(table)
        for key in ("inputs", "beam_args"):
            _check_type("prepare", key, values.get(key, []), list)
            values[key] = tuple(_str_item("prepare", key, v) for v in values.get(key, []))
        values["inputs"] = tuple(_resolve_input(p, base_dir) for p in values["inputs"])
        return cls(**values)


@dataclass(frozen=True)
class PhaseSection:
    name: str  # "phase1" or "phase2", for messages
    recipe: str
    max_seq_length: int
    overrides: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields

    def __post_init__(self) -> None:
        from bertforge.training.config import TrainConfig
        from bertforge.training.recipes import RECIPES

        _check_type(self.name, "recipe", self.recipe, str)
        if self.recipe not in RECIPES:
            raise ValueError(f"{self.name}.recipe: unknown recipe {self.recipe!r}; "
                             f"choose one of {sorted(RECIPES)}")
        _check_type(self.name, "max_seq_length", self.max_seq_length, int)
        _check_at_least(self.name, "max_seq_length", self.max_seq_length, 8)
        _check_type(self.name, "overrides", self.overrides, dict)
        owned = set(_OWNED_TRAIN_FIELDS) | ({"init_from"} if self.name == "phase2" else set())
        known = {f.name for f in fields(TrainConfig)} - owned
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"{self.name}.overrides: unknown or pipeline-owned key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )

    @classmethod
    def from_table(cls, name: str, table: dict[str, Any]) -> PhaseSection:
        _check_keys(name, table, cls)
        for key in ("recipe", "max_seq_length"):
            if key not in table:
                raise ValueError(f"{name}.{key} is required")
        return cls(name=name, **table)


@dataclass(frozen=True)
class ClusterSection:
    workers: int = 2
    gpu: bool = False
    cpus_per_worker: int = 1
    address: str = ""  # "": start a private local Ray on 127.0.0.1
    max_failures: int = 3

    def __post_init__(self) -> None:
        for key in ("workers", "cpus_per_worker", "max_failures"):
            _check_type("cluster", key, getattr(self, key), int)
        _check_type("cluster", "gpu", self.gpu, bool)
        _check_type("cluster", "address", self.address, str)
        _check_at_least("cluster", "workers", self.workers, 1)
        _check_at_least("cluster", "cpus_per_worker", self.cpus_per_worker, 1)
        _check_at_least("cluster", "max_failures", self.max_failures, 0)

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> ClusterSection:
        _check_keys("cluster", table, cls)
        return cls(**table)

    def launch_config(self):
        from bertforge.cluster.ray_train import LaunchConfig

        return LaunchConfig(
            num_workers=self.workers, use_gpu=self.gpu, cpus_per_worker=self.cpus_per_worker,
            address=self.address or None, max_failures=self.max_failures,
        )


_TOP_LEVEL_KEYS = ("workdir", "vocab", "prepare", "phase1", "phase2", "cluster")


@dataclass(frozen=True)
class PipelineConfig:
    workdir: str  # absolute
    prepare: PrepareSection
    phase1: PhaseSection
    phase2: PhaseSection | None = None
    vocab: VocabSection = field(default_factory=VocabSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def __post_init__(self) -> None:
        if "://" in self.workdir:
            # Locking, atomic renames and DeepSpeed's checkpoints need a (shared) file system.
            raise ValueError(f"workdir must be a local or mounted path, got {self.workdir!r}")
        self.train_configs()  # a bad recipe override fails now, before any stage runs

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str) -> PipelineConfig:
        unknown = sorted(set(data) - set(_TOP_LEVEL_KEYS))
        if unknown:
            raise ValueError(f"unknown top-level key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(_TOP_LEVEL_KEYS)}")
        for key in ("workdir", "prepare", "phase1"):
            if key not in data:
                raise ValueError(f"{key} is required" + (f" (a [{key}] table)" if key != "workdir"
                                                         else ""))
        _check_type("config", "workdir", data["workdir"], str)
        prepare = PrepareSection.from_table(data["prepare"], base_dir)
        return cls(
            workdir=_resolve_path(data["workdir"], base_dir),
            prepare=prepare,
            phase1=PhaseSection.from_table("phase1", data["phase1"]),
            phase2=PhaseSection.from_table("phase2", data["phase2"]) if "phase2" in data else None,
            vocab=VocabSection.from_table(data.get("vocab", {}), base_dir),
            cluster=ClusterSection.from_table(data.get("cluster", {})),
        )

    def phases(self) -> list[PhaseSection]:
        return [self.phase1] + ([self.phase2] if self.phase2 else [])

    def train_configs(self) -> dict[str, Any]:
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
            except (TypeError, ValueError) as error:
                raise ValueError(f"{phase.name}: {error}") from None
        return configs

    def settings(self) -> dict[str, Any]:
        """Normalized, JSON-shaped: what pipeline.json records and a later run must match."""
        return _jsonable({
            "config": asdict(self),
            "recipes": {name: cfg.to_dict() for name, cfg in self.train_configs().items()},
        })


def load_config(path: str) -> tuple[PipelineConfig, str]:
    """(validated config, the file's text); relative paths are relative to the file."""
    toml = _toml_module()
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


def _jsonable(value: Any) -> Any:
    """Tuples become lists, as they will be after a round trip through pipeline.json."""
    return json.loads(json.dumps(value))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def differing_keys(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ, leaving out the keys that only say how to run."""
    old, new = _flatten(recorded), _flatten(wanted)

    def ignored(key: str) -> bool:
        return any(key == f"config.{k}" or key.startswith(f"config.{k}.")
                   for k in HOW_TO_RUN_KEYS)

    return sorted(k for k in set(old) | set(new) if not ignored(k) and old.get(k) != new.get(k))


# --- layout ---------------------------------------------------------------------------------


class PipelinePaths:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.state = os.path.join(self.root, STATE_NAME)
        self.vocab_dir = os.path.join(self.root, "vocab")
        self.vocab = os.path.join(self.vocab_dir, "vocab.txt")
        self.hf = os.path.join(self.root, "hf")

    def shards(self, max_seq_length: int) -> str:
        return os.path.join(self.root, f"shards-{max_seq_length}")

    def run(self, phase: str) -> str:
        return os.path.join(self.root, "runs", phase)


# --- stages ---------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    is_done: Callable[[], bool]  # from the outputs on disk
    run: Callable[[], dict[str, Any]]  # returns a record for pipeline.json


def build_stages(
    config: PipelineConfig, paths: PipelinePaths, state: dict[str, Any]
) -> list[Stage]:
    stages = [Stage("vocab", lambda: os.path.isfile(paths.vocab),
                    lambda: _make_vocab(config, paths))]
    for length in sorted({phase.max_seq_length for phase in config.phases()}):
        stages.append(Stage(
            f"prepare-{length}", lambda length=length: _shards_complete(paths.shards(length)),
            lambda length=length: _prepare(config, paths, length),
        ))
    train_configs = config.train_configs()
    for name, cfg in train_configs.items():
        stages.append(Stage(name, lambda cfg=cfg: _training_complete(cfg),
                            lambda cfg=cfg: _train(config, cfg)))
    last_run = paths.run(list(train_configs)[-1])
    stages.append(Stage("export", lambda: _export_complete(paths, last_run, state),
                        lambda: _export(paths, last_run)))
    return stages


def _make_vocab(config: PipelineConfig, paths: PipelinePaths) -> dict[str, Any]:
    from bertforge.pipelines.manifest import sha256_file

    # Built beside its place and renamed in, so a half-written vocab.txt never "exists".
    tmp = paths.vocab_dir + ".tmp"
    fresh_dir(tmp)
    if config.vocab.path:
        if not os.path.isfile(config.vocab.path):
            raise ValueError(f"vocab.path {config.vocab.path} does not exist")
        shutil.copyfile(config.vocab.path, os.path.join(tmp, "vocab.txt"))
        source = config.vocab.path
    else:
        from bertforge.pipelines.readers import split_format
        from bertforge.pipelines.vocab import train_wordpiece_vocab

        inputs = config.vocab.inputs or config.prepare.inputs
        train_wordpiece_vocab([split_format(p)[1] for p in inputs], tmp,
                              vocab_size=config.vocab.size, lower_case=config.vocab.lower_case)
        source = "trained"
    shutil.rmtree(paths.vocab_dir, ignore_errors=True)
    os.replace(tmp, paths.vocab_dir)
    return {"source": source, "sha256": sha256_file(paths.vocab)}


def _shards_complete(data_dir: str) -> bool:
    from bertforge.pipelines.manifest import MANIFEST_NAME

    return os.path.isfile(os.path.join(data_dir, MANIFEST_NAME))


def _prepare(config: PipelineConfig, paths: PipelinePaths, max_seq_length: int) -> dict[str, Any]:
    from bertforge.pipelines.prepare import run as run_prepare

    output = paths.shards(max_seq_length)
    fresh_dir(output)  # no manifest: an attempt that died part-way; its files are suspect
    p = config.prepare
    argv = [f"--input={entry}" for entry in p.inputs] + [
        f"--output={output}", f"--vocab={paths.vocab}",
        f"--lower_case={str(config.vocab.lower_case).lower()}",
        f"--max_seq_length={max_seq_length}", f"--short_seq_prob={p.short_seq_prob}",
        f"--dupe_factor={p.dupe_factor}", f"--seed={p.seed}",
        f"--validation_fraction={p.validation_fraction}", f"--num_shards={p.num_shards}",
        f"--num_validation_shards={p.num_validation_shards}",
        f"--random_pool_size={p.random_pool_size}", *p.beam_args,
    ]
    summary = run_prepare(argv)
    return {"instances": summary.get("instances"), "seconds_in_beam": summary.get("seconds")}


def _training_complete(cfg) -> bool:
    from bertforge.training.checkpoint import committed_steps

    steps = committed_steps(cfg.run_dir)
    return bool(steps) and steps[-1] >= cfg.max_steps


def _train(config: PipelineConfig, cfg) -> dict[str, Any]:
    from bertforge.cluster.ray_train import train_on_ray

    # resume=True: continues from the newest committed checkpoint, or starts fresh (phase 2
    # then warm-starts from phase 1's weights).
    result = train_on_ray(cfg, config.cluster.launch_config())
    if result["step"] < cfg.max_steps:
        raise RuntimeError(f"{cfg.run_dir}: training stopped at step {result['step']}, "
                           f"not {cfg.max_steps}; run the pipeline again to resume")
    return {"step": result["step"], "checkpoint": result["checkpoint_path"]}


def _export_source(run_dir: str) -> dict[str, Any] | None:
    """The final checkpoint and its commit marker: a retrained checkpoint has a new marker."""
    from bertforge.training.checkpoint import COMMIT_MARKER, latest_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        return None
    with open(os.path.join(path, COMMIT_MARKER), encoding="utf-8") as f:
        return {"checkpoint": path, "committed": json.load(f)}


def _export_complete(paths: PipelinePaths, run_dir: str, state: dict[str, Any]) -> bool:
    from bertforge.training.hf_interop import HF_CONFIG_NAME

    files = (HF_CONFIG_NAME, "model.safetensors")
    if not all(os.path.isfile(os.path.join(paths.hf, name)) for name in files):
        return False
    recorded = state["stages"].get("export", {}).get("source")
    return recorded is not None and recorded == _export_source(run_dir)


def _export(paths: PipelinePaths, run_dir: str) -> dict[str, Any]:
    from bertforge.training.export import export_checkpoint

    source = _export_source(run_dir)
    assert source is not None, "export runs after the last phase committed its checkpoint"
    tmp = paths.hf + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(source["checkpoint"], tmp)
    shutil.rmtree(paths.hf, ignore_errors=True)
    os.replace(tmp, paths.hf)
    return {"hf_dir": paths.hf, "source": source}


# --- the run --------------------------------------------------------------------------------


def run_pipeline(config: PipelineConfig, toml_text: str = "") -> dict[str, Any]:
    """Run every stage that is not done; returns {"ran": [...], "skipped": [...], ...}."""
    paths = PipelinePaths(config.workdir)
    ran, skipped = [], []
    with exclusive_directory(paths.root, "pipeline"):
        state = _load_or_create_state(paths, config, toml_text)
        stages = build_stages(config, paths, state)
        for number, stage in enumerate(stages, start=1):
            label = f"[{number}/{len(stages)}] {stage.name}"
            if stage.is_done():
                _say(f"{label}: output complete, skipping")
                skipped.append(stage.name)
                continue
            _say(f"{label}: starting")
            started = time.time()
            with heartbeat("pipeline", label, every_seconds=60.0):
                record = stage.run()
            record["seconds"] = round(time.time() - started, 1)
            state["stages"][stage.name] = record
            write_json_atomic(paths.state, state)
            ran.append(stage.name)
            _say(f"{label}: finished in {record['seconds']} s")
    _say(f"done: Hugging Face export in {paths.hf}")
    return {"workdir": paths.root, "hf_dir": paths.hf, "ran": ran, "skipped": skipped}


def _say(message: str) -> None:
    print(f"[pipeline] {message}", flush=True)


def _load_or_create_state(
    paths: PipelinePaths, config: PipelineConfig, toml_text: str
) -> dict[str, Any]:
    wanted = config.settings()
    if os.path.exists(paths.state):
        with open(paths.state, encoding="utf-8") as f:
            state = json.load(f)
        changed = differing_keys(state["settings"], wanted)
        if changed:
            shown = ", ".join(changed[:12]) + (f" and {len(changed) - 12} more"
                                               if len(changed) > 12 else "")
            raise ValueError(
                f"{paths.root} holds a pipeline made from a different configuration "
                f"(differs in: {shown}); use another workdir, or delete it to start over"
            )
        state["settings"] = wanted  # the how-to-run keys may have changed: record this run's
        state["toml"] = toml_text or state.get("toml", "")
    else:
        _refuse_foreign_directory(paths)
        state = {"version": STATE_VERSION, "toml": toml_text, "settings": wanted, "stages": {}}
    write_json_atomic(paths.state, state)
    return state


def _refuse_foreign_directory(paths: PipelinePaths) -> None:
    """Without pipeline.json every output in the workdir would be someone else's: never reuse
    (or clear) them."""
    if [name for name in os.listdir(paths.root) if name != LOCK_NAME]:
        raise ValueError(f"workdir {paths.root} is not empty and holds no {STATE_NAME}; "
                         "choose an empty or new workdir")


# --- helpers shared in spirit with cluster/demo.py ---------------------------------------------


