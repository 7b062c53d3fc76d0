"""One declaration per option: a config field holds its type, default, help text and flag, and
the command line, a pipeline file's tables and the Beam options are generated from it.

Each job owns a dataclass (`PrepareConfig`, `TrainConfig`, `EngineConfig`, `FinetuneConfig`,
`LaunchConfig`, `DemoConfig`, ...) whose fields are declared with `option(...)`; validation is
the dataclass's own (`__post_init__`). This module reads those fields and never restates them:

- `add_flags` adds one flag per field, `--field-name` (or the field's `flag`; `aliases` keep
  older spellings such as `--steps`), with no argparse default: a flag left out is absent from
  `given_values`, so the dataclass's default is the only one. `beam=True` makes Beam's kind of
  flag (`prepare`'s): Beam's underscore spelling beside the dashed one, `--flag=false`.
- `from_table` checks a TOML table against the same fields (unknown keys, keys a table must
  give: `option(REQUIRED, ...)`, types by annotation) and builds the config, so the pipeline
  file's sections cannot drift from the flags either.
- `same_option` hands one config's declaration to another that offers the same option (the
  engine's options: `training.engine_config.engine_option`); `check_choices` validates fields
  declared with `choices`.

Where a field does not go is said by marks in its declaration, never by a list of names kept
elsewhere:
- `NO_FLAG`: not among the generated flags; the command places the field's flag itself
  (`add_flag`: `bertforge train --data`, first and required) or sets the field from a flag of
  its own (`--preset` sets the model);
- `NOT_IN_FILE`: no key in a pipeline file's table; the pipeline sets it (paths, the vocab's
  casing, each phase's length);
- `RERUN_MAY_CHANGE`: says where or how to run or show, not what is made, so a later run into
  the same directory may change it (left out of the settings a rerun must match).
A config may add marks of its own (`FinetuneConfig`'s `PER_TASK`, `LaunchConfig`'s
`FOR_CHECKPOINTS`); `add_flags(..., without=(MARK,))` leaves the fields carrying them out.

This module lives in pipelines/contract/, the bottom layer's part that training may import (it
imports neither training/ nor cluster/, nor Beam), because every layer declares options:
`PrepareConfig` in pipelines/, the training configs in training/, the launch and the commands'
own in cluster/.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

HELP = "help"
FLAG = "flag"
ALIASES = "aliases"
CHOICES = "choices"
MARKS = "marks"

# option(REQUIRED, ...): a field without a default, which a pipeline file's table must give.
REQUIRED = dataclasses.MISSING

NO_FLAG = "no_flag"
NOT_IN_FILE = "not_in_file"
RERUN_MAY_CHANGE = "rerun_may_change"


def option(default: Any = None, help: str = "", *, flag: str | None = None,
           aliases: tuple[str, ...] = (), choices: tuple[Any, ...] | None = None,
           marks: tuple[str, ...] = ()) -> Any:
    """A config field: its default, its help text (shown by --help as it is), its flag when
    not `--field-name`, older spellings, allowed values and marks (module docstring)."""
    metadata: dict[str, Any] = {HELP: help, ALIASES: tuple(aliases), MARKS: frozenset(marks)}
    if flag is not None:
        metadata[FLAG] = flag
    if choices is not None:
        metadata[CHOICES] = tuple(choices)
    if type(default).__hash__ is None:  # mutable (a dict, a config): a fresh copy per instance
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def same_option(cls: type, name: str, *, choices: tuple[Any, ...] | None = None) -> Any:
    """`cls`'s declaration of `name` (default, help, flag, marks) for another config offering
    the same option, optionally with fewer `choices`."""
    [declared] = [f for f in dataclasses.fields(cls) if f.name == name]
    metadata = declared.metadata
    return option(_default(declared), metadata[HELP], flag=metadata.get(FLAG),
                  aliases=metadata[ALIASES], choices=choices or metadata.get(CHOICES),
                  marks=tuple(metadata[MARKS]))


def marked(f: dataclasses.Field, mark: str) -> bool:
    return mark in f.metadata.get(MARKS, ())


def fields_marked(cls: type, mark: str) -> list[str]:
    """The names of `cls`'s fields that carry `mark`, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if marked(f, mark)]


def without_marked(values: dict[str, Any], cls: type, *marks: str) -> dict[str, Any]:
    """`values` ({field: value} of `cls`) without the fields that carry any of `marks`."""
    dropped = {name for mark in marks for name in fields_marked(cls, mark)}
    return {key: value for key, value in values.items() if key not in dropped}


def check_choices(config: Any) -> None:
    """Every field of `config` declared with `choices` holds one of them (or None, where None
    is its default: "decided later"); else a ValueError naming the field."""
    for f in dataclasses.fields(config):
        value, choices = getattr(config, f.name), f.metadata.get(CHOICES)
        if choices is None or value in choices or (value is None and _default(f) is None):
            continue
        raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")


def _scalar_type(annotation: Any) -> Any:
    """int | None -> int; other annotations as they are."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: _scalar_type(hints[f.name]) for f in dataclasses.fields(cls)}


def flag_spellings(f: dataclasses.Field, *, beam: bool = False) -> tuple[str, ...]:
    """`--max-seq-length` (dashed, as every bertforge command spells its flags, first: --help
    shows it first), its aliases, and for Beam also `--max_seq_length`, Beam's own spelling,
    which Dataflow templates and scripts written for Beam use. A field's own `flag` is taken
    as it is."""
    if FLAG in f.metadata:
        return (f.metadata[FLAG], *f.metadata.get(ALIASES, ()))
    dashed = "--" + f.name.replace("_", "-")
    underscored = (f"--{f.name}",) if beam else ()
    return tuple(dict.fromkeys((dashed, *f.metadata.get(ALIASES, ()), *underscored)))


def with_flag_name(message: str, cls: type) -> str:
    """A config's error that starts with a field's name ("micro_batch_size must be at least
    1") led by the flag a user types for it ("--batch-size (micro_batch_size) must ...",
    "--adam-betas must ..."): the command line's errors name its flags. Other messages are
    returned as they are."""
    name = re.match(r"\w+", message)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name is None or name.group() not in fields or not _has_flag(fields[name.group()], ()):
        return message
    spellings = flag_spellings(fields[name.group()])
    flag = spellings[1] if len(spellings) > 1 else spellings[0]  # the short alias: --batch-size
    said = flag if flag == "--" + name.group().replace("_", "-") else f"{flag} ({name.group()})"
    return said + message[name.end():]


@contextlib.contextmanager
def errors_naming_flags(cls: type) -> Iterator[None]:
    """Around building `cls` from a command line: its ValueError names the flag typed
    (`with_flag_name`)."""
    try:
        yield
    except ValueError as error:
        raise ValueError(with_flag_name(str(error), cls)) from None


def negative_spellings(f: dataclasses.Field, kind: Any, *, beam: bool = False) -> tuple[str, ...]:
    """A Beam-style boolean's `--no-lower-case` (and `--no_lower_case`): the spelling every
    other bertforge command takes, beside Beam's `--lower_case=false`."""
    if not beam or kind is not bool or FLAG in f.metadata:
        return ()
    return (f"--no-{f.name.replace('_', '-')}", f"--no_{f.name}")


def _has_flag(f: dataclasses.Field, without: tuple[str, ...]) -> bool:
    return not marked(f, NO_FLAG) and not any(marked(f, mark) for mark in without)


def add_flags(parser: Any, cls: type, *, without: tuple[str, ...] = (),
              beam: bool = False) -> None:
    """One flag per field of `cls` (but those marked NO_FLAG or with a mark of `without`)."""
    types_by_name = field_types(cls)
    for f in dataclasses.fields(cls):
        if _has_flag(f, without):
            parser.add_argument(*flag_spellings(f, beam=beam),
                                **_argument(cls, f, types_by_name[f.name], beam))
            negative = negative_spellings(f, types_by_name[f.name], beam=beam)
            if negative:
                parser.add_argument(*negative, dest=f.name, action="store_const", const=False,
                                    default=None, help=f"the same as --{negative[0][5:]}=false")


def add_flag(parser: Any, cls: type, name: str, **overrides: Any) -> None:
    """The flag of one field that the command places itself (a field marked NO_FLAG: first and
    required, say); `overrides` go to argparse as they are."""
    [f] = [f for f in dataclasses.fields(cls) if f.name == name]
    options = {**_argument(cls, f, field_types(cls)[name], beam=False), **overrides}
    parser.add_argument(*flag_spellings(f), **options)


def _argument(cls: type, f: dataclasses.Field, kind: Any, beam: bool) -> dict[str, Any]:
    """argparse's keywords for the flag of `f` (of type `kind`)."""
    options: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f, beam)}
    if kind is bool:
        if beam:  # Beam's flags take a value: --lower_case=false
            options.update(type=parse_bool, nargs="?", const=True)
        else:
            options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is tuple:
        items = typing.get_args(kind)
        variadic = Ellipsis in items  # tuple[str, ...]; tuple[float, float] takes 2
        if beam and variadic:
            # Repeatable, as Beam's own list flags are, and several after one flag too, as
            # every other command takes them: `prepare --input a b` (what `vocab` takes, and
            # what the shell makes of an unquoted glob) was refused, b taken for a stray.
            options.update(action="extend", type=items[0], nargs="+")
        elif beam:
            options.update(action="append", type=items[0])
        else:
            options.update(type=items[0], nargs="+" if variadic else len(items),
                           metavar=items[0].__name__.upper())
            if variadic:  # `--input a --input b` is both, as `--input a b` (not b alone)
                options["action"] = "extend"
    elif typing.get_origin(kind) is dict:
        raise TypeError(f"{cls.__name__}.{f.name} is a table: it has no flag form, so its "
                        "declaration must mark it NO_FLAG")
    else:
        options["type"] = kind
    if CHOICES in f.metadata:
        options["choices"] = f.metadata[CHOICES]
    return options


def _help(f: dataclasses.Field, beam: bool) -> str:
    """The field's help and its default; a boolean's default goes unsaid where --no-FLAG exists
    (Beam's flags have none)."""
    text = f.metadata.get(HELP, "")
    default = _default(f)
    unsaid = default is None or default in ((), "") or (isinstance(default, bool) and not beam)
    if unsaid:
        return text.replace("%", "%%")
    return f"{text} (default: {default})".replace("%", "%%").strip()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def given_values(args: Any, cls: type, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """{field: value} for the flags given on the command line (the others keep the default);
    `args` is argparse's namespace or Beam's parsed options."""
    names = [f.name for f in dataclasses.fields(cls) if _has_flag(f, without)]
    return {name: getattr(args, name) for name in names
            if getattr(args, name, None) is not None}


def check_type(section: str, key: str, value: Any, kind: Any) -> Any:
    """A TOML value checked against a field's annotation; lists become tuples for tuple fields."""
    origin = typing.get_origin(kind)
    if origin is tuple:
        item = typing.get_args(kind)[0]
        if not isinstance(value, list):
            raise ValueError(f"{section}.{key} must be a list, got {value!r}")
        return tuple(check_type(section, key, v, item) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{section}.{key} must be a table, got {value!r}")
        return value
    allowed = (int, float) if kind is float else (kind,)
    # bool is an int in Python, but `workers = true` is a mistake, not 1 worker.
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, allowed):
        raise ValueError(f"{section}.{key} must be {kind.__name__}, got {value!r}")
    return value


def required_fields(cls: type) -> list[str]:
    """The names of `cls`'s fields without a default (`REQUIRED`), in declaration order."""
    return [f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def table_keys(cls: type) -> set[str]:
    """The keys a pipeline file's table of `cls` may hold: every field not NOT_IN_FILE."""
    return {f.name for f in dataclasses.fields(cls) if not marked(f, NOT_IN_FILE)}


def from_table(cls: type, section: str, table: Any, *, set_elsewhere: dict[str, str] | None = None,
               also_known: tuple[str, ...] = (), **fixed: Any) -> Any:
    """`cls` built from a TOML table: unknown keys and wrong types are errors naming the key;
    `fixed` supplies the fields the caller sets itself (those NOT_IN_FILE, and any it resolved,
    which the table then cannot set); `set_elsewhere` says where such a key belongs, for the
    error; `also_known` are keys the caller took from the table first. The config's own
    validation runs as usual, its message prefixed with the section."""
    if not isinstance(table, dict):
        raise ValueError(f"[{section}] must be a table, got {table!r}")
    types_by_name = field_types(cls)
    known = sorted(table_keys(cls) - set(fixed) | set(also_known))
    misplaced = [f"{key}: {set_elsewhere[key]}" for key in sorted(table)
                 if key in (set_elsewhere or {})]
    if misplaced:
        raise ValueError(f"[{section}] cannot set {'; '.join(misplaced)}")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) in [{section}]: {', '.join(unknown)}"
                         f"{underscore_hint(unknown, known)}; known: {', '.join(known)}")
    for key in required_fields(cls):
        if key not in table and key not in fixed:
            raise ValueError(f"{section}.{key} is required")
    values = {key: check_type(section, key, value, types_by_name[key])
              for key, value in table.items()}
    try:
        return cls(**values, **fixed)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{section}: {error}") from None


def underscore_hint(unknown: list[str], known: Any) -> str:
    """A file's keys are the fields' names; a flag's dashed spelling there gets pointed out."""
    fixes = [f"{key} -> {key.replace('-', '_')}" for key in unknown
             if "-" in key and key.replace("-", "_") in known]
    return f" (keys are spelled with underscores: {', '.join(fixes)})" if fixes else ""
