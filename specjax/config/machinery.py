"""The generic config machinery: frozen dataclasses <-> plain dicts <-> command-line overrides.

Every config is a frozen dataclass, so it is hashable and can be a static argument to `jax.jit` (the
shape-setting parts: speculation depth, tree, batch size). Lists coming from YAML or Python become tuples for
the same reason. This works for any dataclass:

    from_dict(cls, mapping)          strict: unknown keys, wrong types and missing fields raise ConfigError
    to_dict(cfg) / to_yaml(cfg)      plain dicts / YAML text (tuples become lists)
    merge(cfg, mapping)              deep-merge a (partial) mapping into a config
    apply_overrides(cfg, ["sampling.temperature=0.7", ...])

Reading YAML files and the packaged configs lives in `specjax.config.files`; the configs themselves in
`specjax.config.schema`. Every error is a `ConfigError` (a ValueError) with a one-line message that names the
offending key by its dotted path (`sampling.top_p`) and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import InitVar
from typing import Any, Literal, Optional, TypeVar, Union

import yaml

from specjax.errors import SpecjaxError

__all__ = [
    "ConfigError",
    "from_dict",
    "to_dict",
    "to_yaml",
    "merge",
    "apply_overrides",
    "did_you_mean",
]

T = TypeVar("T")


# --------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------


class ConfigError(SpecjaxError, ValueError):
    """A bad config: unknown key, wrong type, out-of-range value, unreadable file.

    `path` is the dotted location of the problem relative to the config being built ("" = the top level).
    Errors raised while building a nested config are re-raised one level up with the parent's key prefixed,
    so the final message always names the full path (`speculative.num_speculative_tokens`).
    """

    # Placeholder in `template` that is replaced by the (prefixed) path; plain text, never str.format, so
    # braces in user values are safe.
    PATH = "\0path\0"

    def __init__(self, message: str, *, path: str = "", template: Optional[str] = None, root: str = "config"):
        self.path = path
        self.template = template
        self.root = root
        if template is not None:
            message = template.replace(self.PATH, path or root)
        super().__init__(message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error located under `prefix` (a parent key); errors without a location are unchanged."""
        if self.template is None or not prefix:
            return self
        return ConfigError("", path=_join(prefix, self.path), template=self.template, root=self.root)


def _join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    if not path:
        return prefix
    # Sequence indices attach without a dot: stop_token_ids[2].
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def invalid(path: str, value: Any, reason: str) -> ConfigError:
    """`invalid <path>=<value>: <reason>` -- `reason` should end with how to fix it."""
    return ConfigError("", path=path, template=f"invalid {ConfigError.PATH}={value!r}: {reason}")


def did_you_mean(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(key: str, where: str, root: str, choices: Sequence[str]) -> ConfigError:
    hint = did_you_mean(key, choices) or f"; valid keys: {', '.join(sorted(choices))}"
    return ConfigError("", path=where, template=f"unknown key {key!r} in {ConfigError.PATH}{hint}", root=root)


# --------------------------------------------------------------------------------------------------------------
# Generic dataclass machinery
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations (from __future__ import annotations) in cls's module.
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def init_params(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(all keyword names __init__ accepts, the required ones). Includes InitVar aliases such as max_tokens."""
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = tuple(p.name for p in params)
    required = tuple(p.name for p in params if p.default is inspect.Parameter.empty)
    return names, required


def _aliases(cls: type) -> Mapping[str, str]:
    """Alternative key -> canonical field name, declared by a class as `_config_aliases`."""
    return getattr(cls, "_config_aliases", {})


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the annotation `tp` and convert it to its canonical form (lists -> tuples,
    mappings -> dataclasses, ints -> floats). Raises ConfigError located at `path`."""
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise invalid(path, value, "expected null")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, where=path)
        raise invalid(path, value, f"expected a mapping of {tp.__name__} keys, got {type(value).__name__}")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        errors = []
        for member in members:
            try:
                return coerce(member, value, path)
            except ConfigError as err:
                errors.append(err)
        if len(members) == 1:
            # Optional[X]: X's own message (it lists Literal choices) is the most useful one.
            raise errors[0]
        raise invalid(path, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        for choice in args:
            # `True == 1`, so compare types too: a Literal of strings must not accept a bool.
            if value == choice and type(value) is type(choice):
                return choice
        shown = ", ".join(repr(c) for c in args)
        raise invalid(path, value, f"must be one of {shown}{did_you_mean(value, [str(c) for c in args])}")
    if origin in (tuple, list, Sequence, typing.Sequence) or tp in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise invalid(path, value, f"expected a list, got {type(value).__name__}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise invalid(path, value, f"expected a list of exactly {len(args)} items")
            return tuple(coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        return tuple(coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise invalid(path, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise invalid(path, value, f"expected an integer, got {type(value).__name__}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads `1e-3` (no dot) as a string; accept any text float() understands.
            try:
                return float(value)
            except ValueError:
                pass
        raise invalid(path, value, f"expected a number, got {type(value).__name__}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise invalid(path, value, f"expected a string, got {type(value).__name__} (quote it in YAML)")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise invalid(path, value, f"expected {tp.__name__}, got {type(value).__name__}")
    raise TypeError(f"specjax.config cannot check values of type {tp!r} at {path!r}")


def normalize(obj: Any) -> None:
    """Type-check and canonicalize every field of a frozen dataclass in place (for __post_init__)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = coerce(hints[f.name], value, f.name)
        if new is not value:
            object.__setattr__(obj, f.name, new)


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build dataclass `cls` from a (nested) mapping, strictly.

    Unknown keys raise ConfigError with a did-you-mean hint, missing required fields are named, values are
    type-checked and converted (lists -> tuples, nested mappings -> nested dataclasses). `where` is the dotted
    location of `data` inside a larger config, used in error messages.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where or cls.__name__} must be a mapping of {cls.__name__} keys, got {type(data).__name__}")
    names, required = init_params(cls)
    aliases = _aliases(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise unknown_key(repr(key), where, cls.__name__, names)
        name = aliases.get(key, key)
        if name not in names:
            raise unknown_key(key, where, cls.__name__, names)
        if name in kwargs:
            raise ConfigError(
                f"{_join(where, name)} is given twice (once as {key!r}); keep only one of them")
        kwargs[name] = value
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ConfigError(
            "", path=where, root=cls.__name__,
            template=f"missing required key {missing[0]!r} in {ConfigError.PATH}; add it")
    hints = _hints(cls)
    try:
        # Check every value here, not only in __post_init__, so any dataclass gets strict loading.
        for name, value in kwargs.items():
            tp = hints.get(name, Any)
            if isinstance(tp, InitVar):
                tp = tp.type
            kwargs[name] = coerce(tp, value, name)
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(where) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain Python data (dicts, lists, scalars) that `yaml.safe_dump` and `from_dict` accept."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(cfg).__name__}")
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_yaml(cfg: Any) -> str:
    """A config as YAML text that `load_yaml` reads back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`: mappings merge key by key, everything else (lists too) is replaced."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _canonical_keys(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with alias keys renamed to field names, recursively through nested dataclass fields, so a
    merge of {"max_tokens": 64} replaces max_new_tokens instead of conflicting with it."""
    hints = _hints(cls)
    aliases = _aliases(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(key, key) if isinstance(key, str) else key
        sub = _dataclass_in(hints.get(name))
        if sub is not None and isinstance(value, Mapping):
            value = _canonical_keys(sub, value)
        out[name] = value
    return out


def _dataclass_in(tp: Any) -> Optional[type]:
    """The dataclass inside `X` or `Optional[X]`, else None."""
    if tp is None:
        return None
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = members[0] if len(members) == 1 else None
    return tp if (isinstance(tp, type) and dataclasses.is_dataclass(tp)) else None


def merge(cfg: T, mapping: Mapping[str, Any]) -> T:
    """A new config: `mapping` (a possibly partial, nested dict) deep-merged over `cfg`, then re-validated."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"merge needs a mapping, got {type(mapping).__name__}")
    cls = type(cfg)
    merged = deep_merge(to_dict(cfg), _canonical_keys(cls, mapping))
    return from_dict(cls, merged)


def _parse_override_value(text: str, tp: Any) -> Any:
    if text.strip() in ("None", "none"):
        # Python spelling of null; YAML would read it as the string "None".
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if value is not None and not isinstance(value, str) and _accepts_str(tp) and not isinstance(value, (list, dict)):
        # `model.model=123` or `speculative.model=2024` mean the string, not the number.
        value = text
    return value


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    if _is_union(tp):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """A new config with `key.path=value` overrides applied in order (later ones win).

    Values are parsed with `yaml.safe_load`: `7` int, `0.7` float, `true` bool, `[1, 2]` list, `null`/`None`
    null, anything else a string (a string-typed key keeps the raw text, so `model.model=123` is "123").
    """
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the single string {overrides!r}")
    root_cls = type(cfg)
    patch: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. sampling.temperature=0.7)")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        parts = dotted.split(".")
        if not dotted or any(not p for p in parts):
            raise ConfigError(f"override {item!r} has an empty key; write it like sampling.temperature=0.7")
        cls: Optional[type] = root_cls
        canonical: list[str] = []
        tp: Any = None
        for depth, part in enumerate(parts):
            if cls is None:
                parent = ".".join(canonical)
                raise ConfigError(
                    f"override {item!r}: {parent} is a value, not a section; write {parent}=<value>")
            names = [f.name for f in dataclasses.fields(cls)]
            name = _aliases(cls).get(part, part)
            if name not in names:
                raise unknown_key(part, ".".join(canonical), root_cls.__name__,
                                   names + list(_aliases(cls)))
            canonical.append(name)
            tp = _hints(cls)[name]
            cls = _dataclass_in(tp)
        value = _parse_override_value(text, tp)
        node = patch
        for part in canonical[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        leaf = canonical[-1]
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = deep_merge(node[leaf], value)
        else:
            node[leaf] = value
    return merge(cfg, patch)
