"""The one stage runner behind `demo`, `pipeline`, `finetune` (a stage per learning rate and
seed) and `glue` (a stage per task).

A job is a list of `Stage`s run in one directory:
- one run per directory at a time (`exclusive_directory`);
- a state file (`COMMAND.json`: `demo.json`, `pipeline.json`, ...) records the job's settings and
  each finished stage; a directory whose recorded settings differ is refused, naming the keys
  (unless the earlier run made nothing there: a failure never blocks its own fix), and a
  non-empty directory without a state file is someone else's and is never written into;
- a stage is skipped when done: by default when the state records it, or by its own check of its
  outputs (a deleted output is then rebuilt);
- a stage that is not done runs from its start; stages that resume (training) do so themselves;
- progress: a line when a stage starts and ends (with its duration), and a heartbeat while it
  works; a stage whose work ran elsewhere and was reported there is recorded silently.
Run the same command again after any failure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bertforge.cluster.launch.paths import refuse_output_in_the_jobs_copy
from bertforge.cluster.launch.worker_output import LOG_DIR, log_driver_to

# One run per directory: the lock `train` takes too (host, pid, heartbeat; shared filesystems).
from bertforge.cluster.safety.run_lock import LOCK_NAME, exclusive_directory
from bertforge.pipelines.contract.durable_files import write_json_atomic
from bertforge.pipelines.read.readers import lies_within, split_format


@contextmanager
def heartbeat(command: str, label: str, every_seconds: float) -> Iterator[None]:
    """A line every `every_seconds` while a stage works, so a long step never looks hung."""
    stop = threading.Event()
    started = time.time()

    def beat() -> None:
        while not stop.wait(every_seconds):
            print(f"[{command}] {label}: still working ({time.time() - started:.0f} s)",
                  flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fresh_dir(path: str) -> None:
    """An empty directory: a stage that died part-way leaves files that cannot be trusted."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


@dataclass
class Stage:
    name: str
    run: Callable[[], dict[str, Any]]  # returns the stage's record for the state file
    # From the outputs on disk; None: done once the state file records the stage. A string
    # is done too, and said in place of the runner's skip message.
    is_done: Callable[[], bool | str] | None = None
    # The work already ran elsewhere and said so when it finished (the fine-tuning runs of one
    # worker group: rank 0 prints each run's line as it ends): recorded without a line, and the
    # record's own "seconds" (the real duration) kept rather than the recording's.
    ran_elsewhere: bool = False


class StageRunner:
    """Runs a job's stages in `root`: `with StageRunner(...) as runner: runner.run(stages)`.

    `settings` are what a later run must match to reuse this directory's outputs; keys under
    `ignored` (dotted prefixes such as "cluster") only say how to run and may change; `renamed`
    maps a recorded key's dotted path to its name today (a directory an earlier bertforge made
    stays usable); `recorded_since`: keys an older bertforge did not record (dotted: a key in
    a key; a state without one is not refused for it); `may_add` maps a dotted prefix to the
    stage it configures: settings there that the recorded run did not have (a pipeline's [phase2],
    added once phase 1 is done) are no difference while that stage has not run. `scratch`:
    paths under `root` that the command's workers keep for themselves (their logs, state and
    error files), no output: an earlier run that left only those made nothing, and does not
    pin its settings.
    `key_names`: the differing dotted keys as the user's configuration names them, for the
    refusal's line (a pipeline file's `[prepare] num_shards`, not `config.prepare.options...`).
    `defaults`: dotted keys of settings recorded only when given (flags typed), and the value
    each takes when not: a key either side lacks reads as its default, so a flag typed at its
    default value, or left out when it was, is no other setting.
    `remedy`: the changed keys -> what to do to go on, where something smaller than a new
    directory does it ("": that).
    `base_dir`: the folder the job's configuration is relative to (a pipeline file's); paths
    in the settings under it are compared relative to it, so a folder moved or copied with
    its configuration, inputs and outputs is the same job (the state records it).
    """

    def __init__(self, root: str, command: str, settings: dict[str, Any], *,
                 ignored: tuple[str, ...] = (), renamed: dict[str, str] | None = None,
                 may_add: dict[str, str] | None = None, scratch: tuple[str, ...] = (),
                 heartbeat_seconds: float = 60.0, skip_message: str = "output complete, skipping",
                 dir_flag: str = "directory", base_dir: str | None = None,
                 recorded_since: tuple[str, ...] = (), defaults: dict[str, Any] | None = None,
                 remedy: Callable[[list[str]], str] | None = None,
                 key_names: Callable[[list[str]], list[str]] | None = None):
        self.root = os.path.abspath(root)
        self.base_dir = os.path.abspath(base_dir) if base_dir else None
        if self.base_dir and not lies_within(self.root, self.base_dir):
            # A directory outside the base does not move with it, and two configurations in
            # two folders may name it: its settings are compared as absolute paths.
            self.base_dir = None
        self.command = command
        self.settings = json.loads(json.dumps(settings))  # as they read back from the file
        self.ignored = ignored
        self.renamed = renamed or {}
        self.may_add = may_add or {}
        self.recorded_since = recorded_since
        self.defaults = json.loads(json.dumps(defaults or {}))  # tuples as the file has lists
        self.remedy = remedy
        self.key_names = key_names or list  # the dotted keys as the user gave them
        self.scratch = scratch
        self.heartbeat_seconds = heartbeat_seconds
        self.skip_message = skip_message
        self.dir_flag = dir_flag
        self.state_path = os.path.join(self.root, f"{command}.json")
        self.state: dict[str, Any] = {}
        self._lock = None

    def __enter__(self) -> StageRunner:
        # demo, finetune, glue and pipeline outputs (given or default) inside a submit job
        refuse_output_in_the_jobs_copy(self.root, self.dir_flag)
        self._lock = exclusive_directory(self.root, self.command)
        self._lock.__enter__()
        try:
            # Once the lock is ours: looked at before, a run of the same job starting a moment
            # earlier (its lock taken, its state not written yet) made this directory look
            # foreign, and the second run was told to choose another directory instead of
            # being told that the first one is running.
            self._refuse_foreign_directory()
            self.state = self._load_or_create_state()
            # The command's log (the engines' output: cluster.launch.worker_output) in this
            # directory, now that it is ours; the first runner of a process claims it (the
            # demo's, not its fine-tuning's).
            log_driver_to(os.path.join(self.root, LOG_DIR, f"{self.command}.log"))
        except BaseException:
            # A refusal (a foreign directory, other settings) leaves `with` before __exit__
            # could: the lock was held until the garbage collector reached it, so a caller who
            # kept the error (run_pipeline in a notebook) was refused its corrected call as
            # "another bertforge pipeline is running", by itself.
            self._lock.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._lock.__exit__(*exc_info)

    def recorded(self, stage: str) -> dict[str, Any] | None:
        return self.state["stages"].get(stage)

    def moved_since(self, stage: str) -> tuple[str, str] | None:
        """(from, to): the base folder `stage` ran in and today's, when the job's folder was
        moved or copied whole since; for a stage's own check of what it made (a dataset's
        recorded input paths)."""
        then = (self.recorded(stage) or {}).get("base_dir")
        if then and self.base_dir and then != self.base_dir:
            return then, self.base_dir
        return None

    def save(self) -> None:
        write_json_atomic(self.state_path, self.state)

    def run(self, stages: list[Stage]) -> dict[str, list[str]]:
        """Every stage that is not done, in order; {"ran": [...], "skipped": [...]}."""
        ran, skipped = [], []
        for number, stage in enumerate(stages, start=1):
            label = f"[{number}/{len(stages)}] {stage.name}"
            done = stage.is_done() if stage.is_done else stage.name in self.state["stages"]
            if done:
                self.say(f"{label}: {done if isinstance(done, str) else self.skip_message}")
                skipped.append(stage.name)
                continue
            if stage.ran_elsewhere:
                self.state["stages"][stage.name] = stage.run()
                self.save()
                ran.append(stage.name)
                continue
            self.say(f"{label}: starting")
            started = time.time()
            with heartbeat(self.command, label, every_seconds=self.heartbeat_seconds), \
                    _says_how_to_continue(stage.name):
                record = stage.run()
            record["seconds"] = round(time.time() - started, 1)
            if self.base_dir:
                record["base_dir"] = self.base_dir  # where its outputs' recorded paths point
            self.state["stages"][stage.name] = record
            self.save()
            ran.append(stage.name)
            self.say(f"{label}: finished in {record['seconds']} s")
        return {"ran": ran, "skipped": skipped}

    def say(self, message: str) -> None:
        print(f"[{self.command}] {message}", flush=True)

    def _refuse_foreign_directory(self) -> None:
        """Without a state file every file in the directory is someone else's: never reuse
        (or clear) them."""
        if not os.path.isdir(self.root) or os.path.exists(self.state_path):
            return
        # The lock's own files, and those of runs being refused it now (.lock.*)
        if [name for name in os.listdir(self.root)
                if name != LOCK_NAME and not name.startswith(LOCK_NAME + ".")]:
            raise ValueError(f"{self.root} is not empty and holds no bertforge {self.command} "
                             f"({os.path.basename(self.state_path)}); choose an empty or new "
                             f"{self.dir_flag}")

    def _load_or_create_state(self) -> dict[str, Any]:
        if not os.path.exists(self.state_path):
            state = {"settings": self.settings, "stages": {}, "base_dir": self.base_dir}
            write_json_atomic(self.state_path, state)
            return state
        with open(self.state_path, encoding="utf-8") as f:
            state = json.load(f)
        recorded = _with_defaults(_with_todays_names(state["settings"], self.renamed),
                                  self.defaults)
        wanted = _with_defaults(self.settings, self.defaults)
        recorded_base = state.get("base_dir")
        if self.base_dir:
            # A state from before the base was recorded: its paths are read against today's
            # base, so an unmoved folder stays the same job (a moved one differs, as before).
            recorded = relative_paths(recorded, recorded_base or self.base_dir)
            wanted = relative_paths(wanted, self.base_dir)
        recorded_keys = _flatten(recorded)
        # What an older bertforge did not record, it cannot say differed.
        unknown = tuple(key for key in self.recorded_since if not _records(recorded, key))
        changed = [key for key in differing_keys(recorded, wanted, self.ignored + unknown)
                   if not self._added_for_a_stage_to_come(key, recorded_keys, state["stages"])]
        named = self.key_names(changed)
        if changed and not state["stages"] and not self._holds_outputs():
            # An earlier run that failed before it made anything (a mistyped path, say) does
            # not pin its settings: the corrected command simply runs.
            self.say(f"{self.root}: an earlier run with other settings ({', '.join(named[:6])}"
                     f"{' ...' if len(named) > 6 else ''}) made nothing here; starting afresh")
            changed = []
        if changed:
            shown = ", ".join(named[:12]) + (f" and {len(named) - 12} more"
                                             if len(named) > 12 else "")
            remedy = (self.remedy and self.remedy(changed)) or (
                f"use another {self.dir_flag}, or delete it to start over")
            raise ValueError(f"{self.root} holds a {self.command} made with other settings "
                             f"(differs in: {shown}); {remedy}")
        # The ignored keys, and the paths of a moved folder, may have changed: this run's.
        state["settings"] = self.settings
        if self.base_dir:
            # Stages recorded without a base (an older bertforge) ran where the state was
            # recorded: said now, so that a move after this run finds their outputs.
            for record in state["stages"].values():
                if isinstance(record, dict):
                    record.setdefault("base_dir", recorded_base or self.base_dir)
        state["base_dir"] = self.base_dir or recorded_base
        write_json_atomic(self.state_path, state)
        return state

    def _added_for_a_stage_to_come(self, key: str, recorded_keys: dict[str, Any],
                                   stages_done: dict[str, Any]) -> bool:
        """Whether `key` lies under a `may_add` prefix that the recorded settings (flattened,
        `recorded_keys`) left empty, and that prefix's stage has not run (nothing of it can be
        in the directory)."""
        for prefix, stage in self.may_add.items():
            if _under(key, prefix):
                before = [value for name, value in recorded_keys.items() if _under(name, prefix)]
                return stage not in stages_done and all(value is None for value in before)
        return False

    def _holds_outputs(self) -> bool:
        """Whether any file but the state, the lock, the logs and the scratch is there."""
        skipped = (LOCK_NAME, os.path.basename(self.state_path), LOG_DIR, *self.scratch)
        for folder, subfolders, files in os.walk(self.root):
            relative = os.path.relpath(folder, self.root)
            inside = "" if relative == "." else relative + os.sep
            subfolders[:] = [name for name in subfolders if inside + name not in skipped]
            if any(inside + name not in skipped for name in files):
                return True
        return False


@contextmanager
def _says_how_to_continue(stage: str) -> Iterator[None]:
    """A stop (SIGTERM, Ctrl-C) during `stage` whose engine did not say what a rerun does (the
    vocabulary, the export, a training stopped before its first checkpoint) ends with it: the
    line said "stopped by SIGINT" alone, leaving the user to guess whether the stages done
    were lost."""
    from bertforge.cluster.launch import local_ray

    try:
        yield
    except SystemExit as exit_:
        stop = local_ray.as_stop(exit_)
        if stop is None:
            raise
        if "the same command" not in stop.note:  # prepare's and a resumable train's say it
            rerun = f"the same command runs {stage} again, the stages done kept"
            stop.note = f"{stop.note}; {rerun}" if stop.note else f"{stage} unfinished: {rerun}"
        raise stop from exit_


BASE = "<base>"  # stands for the base folder in paths compared relative to it


def relative_paths(value: Any, base: str) -> Any:
    """`value` (JSON-shaped) with every absolute path under `base` written relative to it, as
    `<base>/...`; a `FORMAT:` prefix (`books:/corpus/*.txt`) stays in front."""
    if isinstance(value, dict):
        return {key: relative_paths(item, base) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_paths(item, base) for item in value]
    if not isinstance(value, str) or "://" in value:  # not a path, or a URL
        return value
    forced, path = split_format(value)
    if os.path.isabs(path) and lies_within(path, base):
        relative = os.path.normpath(os.path.join(BASE, os.path.relpath(path, base)))
        return f"{forced}:{relative}" if forced else relative
    return value


def _table_of(settings: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """(the table a dotted key lies in, or None where `settings` have no such table; its key)."""
    *parents, key = dotted.split(".")
    table: Any = settings
    for name in parents:
        table = table.get(name) if isinstance(table, dict) else None
    return (table if isinstance(table, dict) else None), key


def _with_todays_names(settings: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    """`settings` as recorded, each key of `renamed` (a dotted path) under its new name."""
    settings = json.loads(json.dumps(settings))
    for old, new in renamed.items():
        table, key = _table_of(settings, old)
        if table is not None and key in table:
            table[new] = table.pop(key)
    return settings


def _with_defaults(settings: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`settings` with each key of `defaults` (a dotted path under a table they have) that
    they lack set to its default."""
    settings = json.loads(json.dumps(settings))
    for dotted, value in defaults.items():
        table, key = _table_of(settings, dotted)
        if table is not None and key not in table:
            table[key] = value
    return settings


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _under(key: str, prefix: str) -> bool:
    """Whether dotted `key` is `prefix` or lies under it."""
    return key == prefix or key.startswith(f"{prefix}.")


def _records(settings: dict[str, Any], dotted_key: str) -> bool:
    """Whether `settings` hold `dotted_key` (`model_weights.sha256`: a key in a key)."""
    node: Any = settings
    for part in dotted_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def differing_keys(
    recorded: dict[str, Any], wanted: dict[str, Any], ignored: tuple[str, ...] = ()
) -> list[str]:
    """Dotted keys whose values differ, leaving out those under an `ignored` prefix."""
    old, new = _flatten(recorded), _flatten(wanted)

    def is_ignored(key: str) -> bool:
        return any(_under(key, k) for k in ignored)

    return sorted(k for k in set(old) | set(new)
                  if not is_ignored(k) and old.get(k) != new.get(k))
