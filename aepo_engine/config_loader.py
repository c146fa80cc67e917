"""Load, override, check, document and dump configs built from trees of ``msgspec.Struct``.

A config is a tree of ``msgspec.Struct`` classes. Each section is owned by the module it configures
(``RolloutConfig`` lives in ``aepo_engine/rollout/config.py``, ``OptimConfig`` in
``aepo_engine/training/optim.py``, ...); a top-level struct lists the sections as fields. This module knows
no particular section. It:

- reads a raw tree from TOML (``tomllib``), YAML (only if PyYAML is importable), JSON or a dict;
- applies command-line overrides ``--section.key=value`` / ``--section.key value``, turning the string
  into the field's annotated type (bool, int, float, str, Literal, list/tuple, dict, Optional, unions);
- rejects unknown keys (in files and overrides), naming the valid keys of that section and a close match,
  or, for a key a section lists in its ``MOVED_KEYS`` ClassVar, the key's new place;
- loads a renamed key or value under its old name too, with one ``warning:`` line on stderr naming
  the new one: a section's ``RENAMED_KEYS`` ClassVar ({old key: new key}) and ``RENAMED_VALUES``
  ({key: {old value: new value}}), so configs, presets and saved runs written before a rename load;
- builds the structs with ``msgspec.convert``, so types and each struct's ``__post_init__`` cross-field
  checks run; every failure surfaces as one ``ConfigError`` that names the field;
- dumps a config to TOML with help comments (``dump_config``); loading the dump gives an equal config;
- prints ``--help`` listing every field with its type, default and help.

Help text: each field's help comes from ``Annotated[T, msgspec.Meta(description=...)]`` if given, else
from the Google-style ``Attributes:`` block of the struct's docstring::

    class OptimConfig(msgspec.Struct, kw_only=True):
        \"\"\"Optimizer settings.

        Attributes:
            lr: Peak learning rate.
            warmup_steps: Linear warm-up length in optimizer steps; 0 turns warm-up off.
        \"\"\"
        lr: float = 1e-6
        warmup_steps: int = 0

A top-level config composes the sections as fields with default factories; the driver then does::

    class TrainConfig(msgspec.Struct, kw_only=True):
        \"\"\"AEPO training run.

        Attributes:
            seed: Global seed.
            data: Data sources and parsing.
            optim: Optimizer and schedule.
        \"\"\"
        seed: int = 0
        data: DataConfig = msgspec.field(default_factory=DataConfig)
        optim: OptimConfig = msgspec.field(default_factory=OptimConfig)

    cfg = parse_args(TrainConfig)   # --config run.toml --optim.lr=2e-6 --data.train_files=a.parquet
    print(dump_config(cfg))         # and save the same text with every checkpoint

Deliberately left out: environment-variable overrides (a file plus the command line is one source of
truth), and ``None`` in files: TOML has no null, so a field whose value is None is dumped as a comment
and left to its default on load. An Optional field must therefore default to None for dumps to round
trip; ``check_config_class`` flags any that do not (and any field without help).
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import math
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence, TypeVar

import msgspec

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_config_class",
    "coerce",
    "dump_config",
    "field_help",
    "format_help",
    "load_config",
    "loads_config",
    "merge_trees",
    "parse_args",
    "read_config_file",
    "say_renamed",
]

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A config could not be loaded: unknown key, wrong type, bad value or failed cross-field check."""


# --- type introspection ---------------------------------------------------------------------------

def _strip(tp: Any) -> Any:
    """Return ``tp`` without ``Annotated`` wrappers."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    """Return the members of a Union/Optional type, or None if ``tp`` is not a union."""
    tp = _strip(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(_strip(a) for a in typing.get_args(tp))
    return None


def _is_struct(tp: Any) -> bool:
    """A config section: a ``msgspec.Struct`` or a dataclass (e.g. ``aepo_kernels.LossConfig``,
    which stays a dataclass so the kernels package depends on torch alone)."""
    return isinstance(tp, type) and (issubclass(tp, msgspec.Struct) or dataclasses.is_dataclass(tp))


def _section_class(tp: Any) -> type | None:
    """Return the Struct class of a section field (``Struct`` or ``Struct | None``), else None."""
    tp = _strip(tp)
    if _is_struct(tp):
        return tp
    members = _union_members(tp)
    if members:
        structs = [m for m in members if _is_struct(m)]
        if len(structs) == 1 and all(m is type(None) or _is_struct(m) for m in members):
            return structs[0]
    return None


def _is_dict_type(tp: Any) -> bool:
    tp = _strip(tp)
    return tp is dict or typing.get_origin(tp) in (dict, collections.abc.Mapping)


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, msgspec.structs.FieldInfo]:
    """Map each field's key (its encode name) to its ``FieldInfo`` (Structs and dataclasses)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        return {f.name: msgspec.structs.FieldInfo(
            name=f.name, encode_name=f.name, type=hints[f.name],
            default=msgspec.NODEFAULT if f.default is dataclasses.MISSING else f.default,
            default_factory=msgspec.NODEFAULT if f.default_factory is dataclasses.MISSING else f.default_factory,
        ) for f in dataclasses.fields(cls)}
    return {f.encode_name: f for f in msgspec.structs.fields(cls)}


def _default(f: msgspec.structs.FieldInfo) -> Any:
    """Return a field's default value (calling its factory), or ``msgspec.NODEFAULT``."""
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return f.default


def _type_name(tp: Any) -> str:
    """Readable name of an annotation, e.g. ``list[str]``, ``'auto' | 'never'``, ``int | None``."""
    tp = _strip(tp)
    members = _union_members(tp)
    if members:
        return " | ".join(_type_name(m) for m in members)
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    args = typing.get_args(tp)
    if args:
        origin = typing.get_origin(tp)
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


# --- help text ------------------------------------------------------------------------------------

_ATTR_LINE = re.compile(r"^(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)$")


def _docstring_attributes(doc: str | None) -> dict[str, str]:
    """Parse a Google-style ``Attributes:`` block into ``{name: help}``."""
    if not doc:
        return {}
    lines = inspect.cleandoc(doc).splitlines()
    out: dict[str, str] = {}
    in_block, base_indent, current = False, None, None
    for line in lines:
        if not in_block:
            in_block = line.strip() == "Attributes:"
            continue
        if line.strip() and not line.startswith((" ", "\t")):
            break  # next top-level heading ends the block
        indent = len(line) - len(line.lstrip())
        match = _ATTR_LINE.match(line.strip())
        if match and (base_indent is None or indent <= base_indent):
            base_indent, current = indent, match.group(1)
            out[current] = match.group(2).strip()
        elif current and line.strip():
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def field_help(cls: type) -> dict[str, str]:
    """Return the help text of every documented field of a Struct class.

    Args:
        cls: a ``msgspec.Struct`` subclass.

    Returns:
        ``{field name: help}``; ``msgspec.Meta(description=...)`` wins over the docstring.
    """
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        helps.update(_docstring_attributes(klass.__dict__.get("__doc__")))
    for f in _fields(cls).values():
        if typing.get_origin(f.type) is typing.Annotated:
            for meta in typing.get_args(f.type)[1:]:
                if isinstance(meta, msgspec.Meta) and meta.description:
                    helps[f.name] = meta.description
    return helps


def _summary(cls: type) -> str:
    """First line of a class docstring."""
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc).splitlines()[0] if doc else ""


# --- reading files --------------------------------------------------------------------------------

def _parse_text(text: str, fmt: str, source: str) -> dict[str, Any]:
    """Parse config text in ``fmt`` ('toml', 'yaml' or 'json') into a dict."""
    try:
        if fmt == "toml":
            data = tomllib.loads(text)
        elif fmt == "json":
            data = json.loads(text)
        elif fmt == "yaml":
            data = _load_yaml(text)
        else:
            raise ConfigError(f"unknown config format {fmt!r} for {source}: use toml, yaml or json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot parse {source} as {fmt}: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def _load_yaml(text: str) -> Any:
    try:
        import yaml
    except ImportError as err:
        raise ConfigError("YAML configs need PyYAML (`pip install pyyaml`); or write the config as TOML") from err
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse YAML: {err}") from err


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a config file into a raw dict; the format follows the suffix (.toml, .yaml/.yml, .json).

    Args:
        path: the config file.

    Returns:
        The parsed top-level mapping.
    """
    path = Path(path)
    formats = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
    fmt = formats.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: unknown config suffix {path.suffix!r}; use .toml, .yaml, .yml or .json")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return _parse_text(path.read_text(encoding="utf-8"), fmt, str(path))


def merge_trees(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base`` (tables merge, other values replace); the
    one merge of raw config trees (files, presets, a run's saved settings under a command's)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


# --- unknown keys ---------------------------------------------------------------------------------

def _unknown_key_message(cls: type, key: str, path: str, source: str) -> str:
    valid = list(_fields(cls))
    where = f"[{path}]" if path else "the top level"
    moved = getattr(cls, "MOVED_KEYS", {}).get(key)
    if moved is not None:  # a section's ``MOVED_KEYS`` ClassVar: {old key: its new dotted key}
        return f"{_join(path, key)!r} in {source} has moved to {_join(path, moved)!r}; set it there"
    msg = f"unknown key {_join(path, key)!r} in {source}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {_join(path, close[0])!r}?"
    msg += f"{'' if close else '.'} Valid keys in {where}: {', '.join(valid)}"
    hint = getattr(cls, "UNKNOWN_KEY_HINT", "")  # a section's ClassVar: where such keys belong
    return f"{msg}; {hint}" if hint else msg


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_keys(cls: type, raw: Mapping[str, Any], source: str, path: str = "") -> list[str]:
    """Return one message per unknown key in ``raw`` (recursing into sections)."""
    errors: list[str] = []
    fields = _fields(cls)
    for key, value in raw.items():
        if key not in fields:
            errors.append(_unknown_key_message(cls, str(key), path, source))
            continue
        section = _section_class(fields[key].type)
        if section is not None and isinstance(value, Mapping):
            errors += _check_keys(section, value, source, _join(path, key))
    return errors


# --- renamed keys and values ----------------------------------------------------------------------

_SAID: set[str] = set()


def say_renamed(message: str) -> None:
    """One ``warning:`` line per rename and process (a config is often built twice)."""
    if message not in _SAID:
        _SAID.add(message)
        print(f"warning: {message}; the old name still works", file=sys.stderr, flush=True)


def _renamed_key(cls: type, key: str, path: str) -> str:
    """``key``, or its new name when ``cls.RENAMED_KEYS`` lists it (said on stderr)."""
    new = getattr(cls, "RENAMED_KEYS", {}).get(key)
    if new is None:
        return key
    say_renamed(f"{_join(path, key)!r} is now called {_join(path, new)!r}")
    return new


def _rename(cls: type, raw: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """A copy of ``raw`` with the old names of renamed keys and values replaced by the new ones."""
    out: dict[str, Any] = {}
    fields, values = _fields(cls), getattr(cls, "RENAMED_VALUES", {})
    for old, value in raw.items():
        key = _renamed_key(cls, old, path) if isinstance(old, str) else old
        if key != old and key in raw:
            raise ConfigError(f"{_join(path, old)!r} and {_join(path, key)!r} are one setting ({old!r} is its "
                              f"old name): set {_join(path, key)!r} only")
        if isinstance(value, str) and value in values.get(key, {}):
            say_renamed(f"{_join(path, key)} = {value!r} is now called {values[key][value]!r}")
            value = values[key][value]
        section = _section_class(fields[key].type) if key in fields else None
        out[key] = _rename(section, value, _join(path, key)) if section and isinstance(value, Mapping) else value
    return out


# --- command-line overrides -----------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}
_NONE = {"none", "null", "~"}


def _parse_inline(text: str) -> Any:
    """Parse an inline TOML value (``[1, 2]``, ``{a = 1}``), falling back to JSON."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return json.loads(text)


def _coerce_scalar(text: str, tp: Any) -> Any:
    """Turn a command-line string into a scalar of type ``tp``; raise ValueError if it cannot."""
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(f"expected a bool (true/false), got {text!r}")
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is str:
        return text
    if typing.get_origin(tp) is Literal:
        for option in typing.get_args(tp):
            if text == str(option) or (isinstance(option, bool) and text.lower() == str(option).lower()):
                return option
        options = [str(a) for a in typing.get_args(tp)]
        close = difflib.get_close_matches(text, options, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"expected one of {', '.join(map(repr, options))}, got {text!r}{hint}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(text).value if text in {e.value for e in tp} else tp[text].value
    if tp is Any:  # a free-form value (a tools.options table's): as TOML reads it ("3" an int), else the text
        try:
            return _parse_inline(text)
        except ValueError:
            return text
    raise ValueError(f"cannot set a field of type {_type_name(tp)} from the command line")


# Union members are tried in this order so that "3" becomes an int before it becomes a str.
_UNION_ORDER = {type(None): 0, bool: 2, int: 3, float: 4, str: 9}


def _union_rank(tp: Any) -> int:
    if typing.get_origin(tp) is Literal:
        return 1
    return _UNION_ORDER.get(tp, 5)


def _coerce_sequence(text: str, item_types: tuple[Any, ...]) -> list[Any]:
    """Parse ``[a, b]`` (inline TOML/JSON) or ``a,b`` into a list; items take ``item_types``."""
    stripped = text.strip()
    if stripped.startswith("["):
        items = _parse_inline(stripped)
    else:
        items = [part.strip() for part in stripped.split(",")] if stripped else []
    types_ = item_types if len(item_types) == len(items) else (item_types[0],) * len(items)
    return [coerce(item, t) if isinstance(item, str) else item for item, t in zip(items, types_)]


def coerce(text: str, tp: Any) -> Any:
    """Turn a command-line string into a value of annotation ``tp``.

    Args:
        text: the raw string from the command line.
        tp: the field's annotation.

    Returns:
        A builtin value (msgspec.convert later turns lists into tuples etc.).

    Raises:
        ValueError: the string does not fit the type.
    """
    tp = _strip(tp)
    members = _union_members(tp)
    if members:
        if type(None) in members and text.strip().lower() in _NONE:
            return None
        problems = []
        for member in sorted((m for m in members if m is not type(None)), key=_union_rank):
            try:
                return coerce(text, member)
            except ValueError as err:
                problems.append(str(err))
        raise ValueError(f"{text!r} fits none of {_type_name(tp)} ({'; '.join(problems)})")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence) or tp in (list, tuple):
        item_types = tuple(a for a in args if a is not Ellipsis) or (Any,)
        return _coerce_sequence(text, item_types if origin is tuple else item_types[:1])
    if _is_dict_type(tp):
        value = _parse_inline(text.strip())
        if not isinstance(value, dict):
            raise ValueError(f"expected an inline table like {{a = 1}} or a JSON object, got {text!r}")
        return value
    return _coerce_scalar(text, tp)


def _resolve(cls: type, dotted: str) -> tuple[list[str], Any]:
    """Resolve ``a.b.c`` against the struct tree; return the key path and the leaf annotation."""
    keys, current, path = [], cls, ""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = _fields(current)
        key = part if part in fields else part.replace("-", "_")
        key = key if key in fields else _renamed_key(current, key, path)
        if key not in fields:
            raise ConfigError(_unknown_key_message(current, part, path, "command-line overrides"))
        keys.append(key)
        tp = fields[key].type
        rest = parts[i + 1:]
        section = _section_class(tp)
        if not rest:
            if section is not None:
                example = next(iter(_fields(section)))
                raise ConfigError(f"--{dotted} is a section; set its fields, e.g. --{dotted}.{example}=...")
            return keys, tp
        if section is not None:
            current, path = section, _join(path, key)
            continue
        if _is_dict_type(tp):
            value_type = (typing.get_args(_strip(tp)) or (str, Any))[1]
            if len(rest) > 1 and _is_dict_type(value_type):  # --tools.options.NAME.key=value
                inner = (typing.get_args(_strip(value_type)) or (str, Any))[1]
                return keys + [rest[0], ".".join(rest[1:])], inner
            return keys + [".".join(rest)], value_type
        raise ConfigError(f"--{dotted}: {_join(path, key)!r} is a {_type_name(tp)}, not a section")
    raise ConfigError(f"empty override key --{dotted}")


def _is_bool_type(tp: Any) -> bool:
    tp = _strip(tp)
    return tp is bool or (_union_members(tp) or ()) in ((bool, type(None)), (type(None), bool))


def _split_overrides(cls: type, argv: Sequence[str]) -> list[tuple[str, str]]:
    """Split ``--a.b=v`` / ``--a.b v`` / bare bool ``--a.b`` tokens into (key, text) pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --section.key=value")
        key, eq, text = token[2:].partition("=")
        if not eq:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if next_is_value:
                text, i = argv[i + 1], i + 1
            elif _is_bool_type(_resolve(cls, key)[1]):
                text = "true"  # a bare --flag switches a bool on
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE")
        pairs.append((key, text))
        i += 1
    return pairs


def apply_overrides(cls: type, raw: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    """Apply command-line overrides to a raw config tree.

    Args:
        cls: the top-level Struct class (gives the keys and the types).
        raw: the raw tree from files/dicts; not modified.
        argv: tokens like ``["--optim.lr=1e-5", "--data.train_files", "a.parquet,b.parquet"]``.

    Returns:
        A new raw tree with the overridden values, already converted to the fields' types.
    """
    out = merge_trees({}, raw)
    for dotted, text in _split_overrides(cls, argv):
        keys, tp = _resolve(cls, dotted)
        try:
            value = coerce(text, tp)
        except ValueError as err:
            raise ConfigError(f"--{dotted}={text}: {err}") from err
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            node[key] = child = dict(child) if isinstance(child, Mapping) else {}
            node = child
        node[keys[-1]] = value
    return out


# --- building -------------------------------------------------------------------------------------

_AT = re.compile(r"^(.*) - at `\$\.?(.*)`$", re.DOTALL)


def _build(cls: type[S], raw: Mapping[str, Any], source: str) -> S:
    """Check for unknown keys, then convert ``raw`` into ``cls`` (types + ``__post_init__`` checks)."""
    raw = _rename(cls, raw)
    errors = _check_keys(cls, raw, source)
    if errors:
        raise ConfigError("\n".join(errors))
    try:
        return msgspec.convert(raw, cls, str_keys=True)
    except msgspec.ValidationError as err:
        raise ConfigError(_explain(str(err), source)) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config ({source}): {err}") from err


def _explain(message: str, source: str) -> str:
    """Rewrite msgspec's ``... - at `$.a.b``` into a message that names the field or section."""
    match = _AT.match(message)
    if not match:
        return f"invalid config ({source}): {message}"
    text, where = match.group(1), match.group(2)
    return f"invalid config at {where or 'top level'!r} ({source}): {text}"


def load_config(
    cls: type[S],
    path: str | Path | Sequence[str | Path] | None = None,
    data: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> S:
    """Build a config from files, a dict and command-line overrides (later sources win).

    Args:
        cls: the top-level Struct class.
        path: a config file (or several, merged in order): .toml, .yaml/.yml or .json.
        data: a raw dict merged over the files.
        overrides: command-line tokens, e.g. ``["--optim.lr=1e-5"]``, applied last.

    Returns:
        The validated config.

    Raises:
        ConfigError: unknown keys, wrong types, bad values or a failed cross-field check.
    """
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    # Only what the sources set: every other field takes its class default when the structs are
    # built (one default per field; check_config_class rejects section factories with others).
    raw: dict[str, Any] = {}
    sources = []
    for p in paths:
        raw = merge_trees(raw, read_config_file(p))
        sources.append(str(p))
    if data:
        raw = merge_trees(raw, data)
        sources.append("dict")
    source = " + ".join(sources) or "defaults"
    raw = _rename(cls, raw)
    errors = _check_keys(cls, raw, source)  # report file typos before override errors
    if errors:
        raise ConfigError("\n".join(errors))
    if overrides:
        raw = apply_overrides(cls, raw, overrides)
        source += " + command line"
    return _build(cls, raw, source)


def _default_tree(cls: type) -> dict[str, Any]:
    """The default config as plain data, or {} when the class has required fields."""
    try:
        return msgspec.to_builtins(cls())
    except (TypeError, ValueError):
        return {}


def loads_config(cls: type[S], text: str, fmt: Literal["toml", "yaml", "json"] = "toml") -> S:
    """Build a config from text (e.g. the ``config.toml`` saved with a checkpoint).

    Args:
        cls: the top-level Struct class.
        text: the config text.
        fmt: its format.

    Returns:
        The validated config.
    """
    return _build(cls, _parse_text(text, fmt, f"<{fmt} text>"), f"<{fmt} text>")


def parse_args(
    cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None, exit_on_error: bool = True
) -> S:
    """Command-line entry: ``[--config FILE ...] [--section.key=value ...] [-h]``.

    Args:
        cls: the top-level Struct class.
        argv: the arguments (default ``sys.argv[1:]``).
        prog: program name for the usage line.
        exit_on_error: print a ConfigError and exit with status 2 instead of raising it.

    Returns:
        The validated config. ``-h/--help`` prints every field and exits with status 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(cls, prog))
        raise SystemExit(0)
    try:
        files, rest = pop_option(argv, "--config")
        return load_config(cls, path=files, overrides=rest)
    except ConfigError as err:
        if not exit_on_error:
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


def pop_option(argv: list[str], option: str) -> tuple[list[str], list[str]]:
    """Separate a repeatable ``--option VALUE`` / ``--option=VALUE`` from the other arguments.

    Returns:
        ``(values, rest)``.
    """
    values, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if token == option:
            if i + 1 >= len(argv):
                raise ConfigError(f"{option} needs a value")
            values.append(argv[i + 1])
            i += 2
            continue
        if token.startswith(f"{option}="):
            values.append(token.split("=", 1)[1])
        else:
            rest.append(token)
        i += 1
    return values, rest


# --- dumping --------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    """Render a builtin value as an inline TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise ConfigError("TOML cannot hold None inside a list or table")
    raise ConfigError(f"cannot write a {type(value).__name__} to TOML")


def _comment(text: str, width: int = 100) -> list[str]:
    """Wrap help text into ``# `` comment lines."""
    import textwrap

    return [f"# {line}" for line in textwrap.wrap(text, width - 2)] if text else []


def _dump_struct(obj: msgspec.Struct, path: str, comments: bool, lines: list[str]) -> None:
    """Append ``obj``'s scalar fields, then each sub-section under its own ``[path.key]`` header."""
    helps = field_help(type(obj)) if comments else {}
    sections = []
    for f in _fields(type(obj)).values():
        value = getattr(obj, f.name)
        if _is_struct(type(value)):
            sections.append((f, value))
            continue
        lines += _comment(helps.get(f.name, ""))
        if value is None:
            lines.append(f"# {_toml_key(f.encode_name)} = (none)")
        else:
            lines.append(f"{_toml_key(f.encode_name)} = {_toml_value(msgspec.to_builtins(value))}")
    for f, value in sections:
        header = _join(path, _toml_key(f.encode_name))
        lines.append("")
        lines += _comment(helps.get(f.name, "") or _summary(type(value)))
        lines.append(f"[{header}]")
        _dump_struct(value, header, comments, lines)


def dump_config(cfg: msgspec.Struct, comments: bool = True) -> str:
    """Render a config as TOML, to print at start and to save with each checkpoint.

    Args:
        cfg: a config struct (top-level or a single section).
        comments: write each field's help as a comment above it.

    Returns:
        TOML text; ``loads_config(type(cfg), text) == cfg``.
    """
    lines: list[str] = []
    _dump_struct(cfg, "", comments, lines)
    return "\n".join(lines).lstrip("\n") + "\n"


# --- help and class checks ------------------------------------------------------------------------

def _iter_fields(cls: type, path: str = "") -> Iterable[tuple[str, type, msgspec.structs.FieldInfo]]:
    """Yield (dotted key, owning class, field) for every leaf field, depth first."""
    for key, f in _fields(cls).items():
        section = _section_class(f.type)
        if section is None:
            yield _join(path, key), cls, f
        else:
            yield from _iter_fields(section, _join(path, key))


def _default_text(f: msgspec.structs.FieldInfo) -> str:
    value = _default(f)
    if value is msgspec.NODEFAULT:
        return "required"
    if value is None:
        return "none"
    try:
        return _toml_value(msgspec.to_builtins(value))
    except ConfigError:
        return repr(value)


def _effective_default_text(tree: dict[str, Any], dotted: str, f: msgspec.structs.FieldInfo) -> str:
    """The default a run actually gets: the value in the full default tree (a section built by a
    parent's default factory may differ from its class's own defaults), else the field's own."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _default_text(f)
        node = node[key]
    if node is None:
        return "none"
    try:
        return _toml_value(node)
    except ConfigError:
        return repr(node)


def format_help(cls: type, prog: str | None = None, defaults: Any = None, defaults_from: str = "",
                usage: str = "[--config FILE.toml|.yaml] [--section.key=value ...]") -> str:
    """List every field as ``--section.key  TYPE = DEFAULT`` with its help, grouped by section.

    Args:
        cls: the top-level Struct class.
        prog: program name for the usage line.
        defaults: the config whose values are shown as DEFAULT (what a run with the same files
            would get); None shows ``cls()``'s.
        defaults_from: where those values come from, printed above the list.
        usage: the options part of the usage line.

    Returns:
        The help text.
    """
    tree = msgspec.to_builtins(defaults) if defaults is not None else _default_tree(cls)
    lines = [f"usage: {prog or 'aepo'} {usage}", ""]
    if _summary(cls):
        lines += [_summary(cls), ""]
    if defaults_from:
        lines += [f"DEFAULT values below: {defaults_from}", ""]
    last_owner = None
    for dotted, owner, f in _iter_fields(cls):
        section = dotted.rpartition(".")[0]
        if owner is not last_owner:
            lines.append(f"[{section}]  {_summary(owner)}" if section else "top-level options")
            last_owner = owner
        lines.append(f"  --{dotted}  {_type_name(f.type)} = {_effective_default_text(tree, dotted, f)}")
        help_text = field_help(owner).get(f.name, "(no help)")
        lines += [f"      {line}" for line in _wrap(help_text, 94)]
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def check_config_class(cls: type) -> list[str]:
    """Return problems in a config class tree: fields without help, Optional fields with a non-None
    default (their None would not survive a TOML dump), fields without a default, and sections
    whose default factory builds other values than the section class's own defaults (a second
    source of defaults).

    Args:
        cls: the top-level Struct class.

    Returns:
        One message per problem; empty when the tree is fine.
    """
    problems = []
    for dotted, owner, f in _iter_fields(cls):
        if f.name not in field_help(owner):
            problems.append(f"{owner.__name__}.{f.name} ({dotted}) has no help text")
        default = _default(f)
        if default is msgspec.NODEFAULT:
            problems.append(f"{dotted} has no default")
        elif type(None) in (_union_members(f.type) or ()) and default is not None:
            problems.append(f"{dotted} is Optional but defaults to {default!r}; None would not round-trip")
    problems += _second_default_sources(cls)
    return problems


def _second_default_sources(cls: type, path: str = "") -> list[str]:
    """Sections built by their parent with values that differ from their own class defaults."""
    problems = []
    for key, f in _fields(cls).items():
        section = _section_class(f.type)
        if section is None:
            continue
        default = _default(f)
        if _is_struct(type(default)):
            try:
                own = section()
            except (TypeError, ValueError):
                own = None
            if own is not None and default != own:
                problems.append(f"{_join(path, key)}: the parent's default differs from {section.__name__}()'s "
                                "own defaults; set the values in the section class or in a preset")
        problems += _second_default_sources(section, _join(path, key))
    return problems
