"""A tree of config dataclasses from TOML and ``--set a.b=value`` overrides: a TOML value must have its field's
type (``coerce``), a ``--set`` value (text) is parsed as it, unknown keys are named with the valid ones, and the
value checks the sections call. Generic: it knows
nothing about training; trainer/config.py holds the sections."""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import tomllib
import types
import typing
from typing import Any

from dutycycle.engine.errors import ConfigError

# Field metadata of a section that holds another component's config dataclass: that dataclass's fields are keys
# of the section's own table (``data.prefetch``, not ``data.loader.prefetch``), all but the hidden ones.
FLAT = "config_flat"


def flat(default_factory, hidden: tuple[str, ...] = ()):
    """A section field holding a config dataclass whose fields (less ``hidden``) are keys of this section."""
    return dataclasses.field(default_factory=default_factory, metadata={FLAT: frozenset(hidden)})


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_keys(cls) -> dict[str, tuple[Any, str | None]]:
    """The keys of section ``cls``: name -> (its type, the flat field holding it, or None for a field of its own)."""
    hints = field_types(cls)
    keys: dict[str, tuple[Any, str | None]] = {}
    for f in dataclasses.fields(cls):
        if FLAT not in f.metadata:
            keys[f.name] = (hints[f.name], None)
            continue
        inner = field_types(hints[f.name])
        for g in dataclasses.fields(hints[f.name]):
            if g.name not in f.metadata[FLAT]:
                keys[g.name] = (inner[g.name], f.name)
    return keys


def as_tree(section) -> dict[str, Any]:
    """A section (or the whole config) as the nested dict ``build`` takes back: flat fields spread into their
    section's table."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if FLAT in f.metadata:
            out.update({k: v for k, v in as_tree(value).items() if k not in f.metadata[FLAT]})
        elif dataclasses.is_dataclass(value):
            out[f.name] = as_tree(value)
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """What ``dataclasses.asdict`` makes of a field value: containers copied, tuples kept."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


# What a value of each TOML (or JSON) type is called in an error message.
TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", dict: "a table",
              list: "an array", tuple: "an array"}


def toml_type(value: Any) -> str:
    """The TOML type of a parsed value, as a message names it ("a string", "an integer", ...)."""
    for tp in (bool, int, float, str, dict, list, tuple):  # bool before int: True is an int in Python
        if isinstance(value, tp):
            return TOML_TYPES[tp]
    return f"a {type(value).__name__}"  # TOML's dates and times


def expected_type(tp: Any) -> str:
    """How a message names the type a field takes."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return expected_type(next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return "one of " + ", ".join(json_text(a) for a in args)
    if origin is dict:
        return "a table"
    if origin is collections.abc.Sequence:
        one = expected_type(args[0]).split(" ", 1)[1]  # "number" of "a number"
        return f"an array of {one}s, or one {one}"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def json_text(value: Any) -> str:
    """A value as TOML writes it (strings in double quotes, true/false lower case)."""
    return json.dumps(value)


def shown(value: Any) -> str:
    """A value in a message, as TOML writes it where it can."""
    return json_text(value) if isinstance(value, (str, bool, int, float)) else repr(value)


def wrong_type(key: str, value: Any, tp: Any, hint: str = "") -> ConfigError:
    return ConfigError(f"{key} = {shown(value)} is {toml_type(value)}; {expected_type(tp)} is expected{hint}")


def coerce(key: str, value: Any, tp: Any, text: bool = False) -> Any:
    """``value`` as the field type ``tp``, or a ConfigError naming the key, the type found and the type expected.

    ``text=False``: a value from a TOML file (or a run's ``config.json``, or a dict) already has a type, and it
    must be the field's: ``global_batch_size = "64"`` is a string and is refused, as is ``flip = "true"``. The one
    widening is an integer for a float (``lr = 1``): TOML writes whole numbers without a point and nothing is
    lost. The reverse is refused, ``64.0`` for an integer included: a count written as a float is more often a
    slip (``warmup_steps = 0.1`` meant as a fraction) than a whole number, and accepting ``64.0`` while refusing
    ``64.5`` would make a value's fate depend on its digits. ``text=True``: a ``--set KEY=VALUE`` value, which is
    text on the command line, parsed as the field's type (``--set data.global_batch_size=64``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise AssertionError(f"unsupported union type for {key}")
        # TOML has no null: a key left out keeps None (the default); a JSON round trip brings None back
        return None if value is None else coerce(key, value, inner[0], text)
    if origin is typing.Literal:  # a closed set of words, e.g. parallel.use_gpu = "auto" | "true" | "false"
        if isinstance(value, bool) and ("true" in args or "false" in args):
            value = "true" if value else "false"  # TOML's own true/false for a key whose words include them
        elif text and isinstance(value, str):
            value = value.strip()
        if value not in args:
            raise ConfigError(f"{key} = {shown(value)} is not {expected_type(tp)}")
        return value
    if origin is dict:
        if text and isinstance(value, str):
            value = parse_value(key, value, "a TOML inline table", f'{key}={{zone="a"}}')
        if not isinstance(value, dict):
            raise wrong_type(key, value, tp, f', e.g. {key} = {{zone = "a"}}')
        inner = args[1] if len(args) == 2 else str
        return {str(k): coerce(f"{key}.{k}", v, inner) for k, v in value.items()}
    if origin is collections.abc.Sequence:  # e.g. data.augment.mean: a list, or one value for all channels
        if text and isinstance(value, str):
            value = parse_value(key, value, "a TOML array or number", f"{key}=[0.5, 0.5, 0.5]")
        return tuple(coerce(key, v, args[0]) for v in (value if isinstance(value, (list, tuple)) else [value]))
    if text and isinstance(value, str):
        return _parse_text(key, value, tp)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp not in (bool, int, float, str):
        raise AssertionError(f"unsupported field type {tp} for {key}")
    hint, name = "", key.rsplit(".", 1)[-1]
    if isinstance(value, str) and tp in (int, float, bool):
        try:
            hint = f" (write it without quotes: {name} = {shown(_parse_text(key, value.strip(), tp))})"
        except ConfigError:
            pass
    elif isinstance(value, float) and tp is int and value.is_integer():
        hint = f" (write {int(value)})"
    elif not isinstance(value, (dict, list, tuple)) and tp is str:
        hint = f" (write it in quotes: {name} = {json_text(json_text(value))})"
    raise wrong_type(key, value, tp, hint)


def _parse_text(key: str, value: str, tp: Any) -> Any:
    """A ``--set`` value (text) as a bool, int, float or str field's value."""
    if tp is bool:
        if value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    if tp is int:
        try:
            return int(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} = {value!r} is not an integer") from None
    if tp is float:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key} = {value!r} is not a number") from None
    if tp is str:
        return value
    raise AssertionError(f"unsupported field type {tp} for {key}")


def parse_value(key: str, text: str, kind: str, example: str) -> Any:
    """A ``--set`` value written in TOML (an inline table, an array)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{key} = {text!r} is not {kind}; write e.g. {example}") from e


def build(cls, data: dict[str, Any], prefix: str = "", aliases: dict[str, str] | None = None):
    """An instance of dataclass ``cls`` from a nested dict (parsed TOML), every value coerced to its field's type;
    an unknown key raises ConfigError naming it and the valid ones. ``aliases`` maps dotted keys that cannot be
    field names (``checkpoint.async``) to the field's."""
    aliases = aliases or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a table, got {data!r}")
    data = {aliases.get(f"{prefix}.{k}", f"{prefix}.{k}").rsplit(".", 1)[-1]: v for k, v in data.items()}
    keys = section_keys(cls)
    unknown = sorted(set(data) - set(keys))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(keys))}")
    kwargs: dict[str, Any] = {}
    held: dict[str, dict[str, Any]] = {}  # flat field -> the values of its keys given here
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp, holder = keys[name]
        value = build(tp, value, key, aliases) if dataclasses.is_dataclass(tp) else coerce(key, value, tp)
        if holder is None:
            kwargs[name] = value
        else:
            held.setdefault(holder, {})[name] = value
    for f in dataclasses.fields(cls):
        if FLAT in f.metadata:
            default = f.default_factory()
            try:  # the loader's config objects check their values when built
                kwargs[f.name] = dataclasses.replace(default, **held.get(f.name, {}))
            except ConfigError as e:
                raise renamed(e, type(default), prefix) from None
    try:  # the loader's config objects check their values when built
        return cls(**kwargs)
    except ConfigError as e:
        raise renamed(e, cls, prefix) from None


def set_dotted(root: type, tree: dict[str, Any], dotted: str, raw: str, aliases: dict[str, str] | None = None) -> None:
    """Apply one ``a.b=value`` override to the nested dict ``tree`` of dataclass ``root``, coercing the value to
    the field's type."""
    dotted = (aliases or {}).get(dotted, dotted)
    parts = dotted.split(".")
    cls: Any = root
    node = tree
    for i, part in enumerate(parts):
        key = ".".join(parts[: i + 1])
        keys = section_keys(cls)
        if part not in keys:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {', '.join(sorted(keys))}")
        tp = keys[part][0]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"{key} is a section; set one of its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
            node = node.setdefault(part, {})
            cls = tp
        else:
            if not last:
                raise ConfigError(f"unknown config key {dotted!r}: {key} is not a section")
            node[part] = coerce(dotted, raw, tp, text=True)


def add_overrides(parser, what: str = "a config key") -> None:
    """The ``--set KEY=VALUE`` option (repeatable) on an argparse parser, collected in ``args.overrides``: what
    ``load_config`` takes as ``overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override {what}, e.g. --set optim.lr=0.01 (repeatable)")


def parse_overrides(items: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value, e.g. --set optim.lr=0.01")
        k, v = item.split("=", 1)
        out.append((k.strip(), v.strip()))
    return out


def renamed(err: ConfigError, cls: type, where: str) -> ConfigError:
    """The loader's and the cache reader's config objects name a bad field ``Class.field``; in this tree the
    same field is the dotted key ``where.field``, which is what a user can set."""
    text = str(err).replace(f"{cls.__name__}.", f"{where}.").replace(f"{cls.__name__} ", f"{where} ")
    return ConfigError(text if where in text else f"{where}: {text}")


# ------------------------------------------------------------------------------------------ value checks


def one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(str, allowed))}")


def positive(where: str, section: Any, *names: str) -> None:
    for name in names:
        v = getattr(section, name)
        if v <= 0:
            raise ConfigError(f"{where}.{name} = {v} must be positive")


def not_negative(where: str, section: Any, *names: str) -> None:
    for name in names:
        v = getattr(section, name)
        if v < 0:
            raise ConfigError(f"{where}.{name} = {v} must not be negative")
