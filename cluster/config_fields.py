"""Command-line flags and TOML tables generated from a job's typed config (one source of truth).

Each job owns a dataclass (`TrainConfig`, `LaunchConfig`, `PrepareConfig`, `DemoConfig`) whose
fields carry their default, their validation (`__post_init__`) and their help text
(`field(metadata={"help": ...})`). This module reads those fields; it never restates them:

- `add_flags` adds one argparse flag per field, `--field-name` (metadata `"aliases"` keeps older
  spellings such as `--steps`), with no argparse default: a flag left out is absent from
  `given_values`, so the dataclass's own default is the only one.
- `from_table` checks a TOML table against the same fields (unknown keys, types by annotation)
  and builds the config, so the pipeline file's sections cannot drift from the flags either.

A field that the command line sets some other way (the `--data` of `data_dir`, say) is named in
the caller's `skip`; tests check that every field has a flag or a TOML key.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

HELP = "help"
ALIASES = "aliases"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


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


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` not in `skip`, help from the field's metadata."""
    types_by_name = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        names = [flag_name(f.name), *f.metadata.get(ALIASES, ())]
        kind = types_by_name[f.name]
        options: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            items = typing.get_args(kind)
            variadic = Ellipsis in items  # tuple[str, ...]; tuple[float, float] takes 2
            options.update(type=items[0], nargs="+" if variadic else len(items),
                           metavar=items[0].__name__.upper())
        elif typing.get_origin(kind) is dict:
            continue  # structured fields have a hand-written flag (see the caller's skip)
        else:
            options["type"] = kind
            if "choices" in f.metadata:
                options["choices"] = f.metadata["choices"]
        parser.add_argument(*names, **options)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata.get(HELP, "")
    default = _default(f)
    if default is None or default == () or isinstance(default, bool):
        return text.replace("%", "%%")
    return f"{text} (default: {default})".replace("%", "%%").strip()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def given_values(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict:
    """{field: value} for the flags given on the command line (the others keep the default)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
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


def from_table(
    cls: type, section: str, table: Any, *, skip: tuple[str, ...] = (), **fixed: Any
) -> Any:
    """`cls` built from a TOML table: unknown keys and wrong types are errors naming the key;
    `fixed` supplies the fields the caller owns (listed in `skip` so the table cannot set them).
    The config's own validation runs as usual, its message prefixed with the section."""
    if not isinstance(table, dict):
        raise ValueError(f"[{section}] must be a table, got {table!r}")
    types_by_name = field_types(cls)
    known = sorted(set(types_by_name) - set(skip) - set(fixed))
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) in [{section}]: {', '.join(unknown)}"
                         f"{underscore_hint(unknown, known)}; known: {', '.join(known)}")
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


def table_keys(cls: type, skip: tuple[str, ...] = ()) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - set(skip)
