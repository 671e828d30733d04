"""specjax's one config system: frozen dataclasses <-> YAML <-> command-line overrides.

Every config is a frozen dataclass, so it is hashable and can be a static argument to `jax.jit` (the
shape-setting parts: speculation depth, tree, batch size). Lists coming from YAML or Python become tuples for
the same reason. The generic machinery works for any dataclass:

    from_dict(cls, mapping)          strict: unknown keys, wrong types and missing fields raise ConfigError
    to_dict(cfg) / to_yaml(cfg)      plain dicts / YAML text (tuples become lists)
    load_yaml(cls, path)             a YAML file (which may `include:` other files) into `cls`
    merge(cfg, mapping)              deep-merge a (partial) mapping into a config
    apply_overrides(cfg, ["sampling.temperature=0.7", ...])
    packaged_config_path("methods/ngram")   a YAML shipped in `specjax.configs`, else a filesystem path

Every error is a `ConfigError` (a ValueError) with a one-line message that names the offending key by its
dotted path (`sampling.top_p`) and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import inspect
import math
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union

import yaml

from specjax.errors import SpecjaxError

__all__ = [
    "ConfigError",
    "ModelConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "BackendConfig",
    "RunConfig",
    "SPECULATIVE_METHODS",
    "from_dict",
    "to_dict",
    "to_yaml",
    "load_yaml",
    "load_yaml_dict",
    "merge",
    "apply_overrides",
    "packaged_config_path",
    "available_configs",
    "load_run_config",
]

T = TypeVar("T")

_YAML_SUFFIXES = (".yaml", ".yml")


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


def _invalid(path: str, value: Any, reason: str) -> ConfigError:
    """`invalid <path>=<value>: <reason>` -- `reason` should end with how to fix it."""
    return ConfigError("", path=path, template=f"invalid {ConfigError.PATH}={value!r}: {reason}")


def _did_you_mean(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key(key: str, where: str, root: str, choices: Sequence[str]) -> ConfigError:
    hint = _did_you_mean(key, choices) or f"; valid keys: {', '.join(sorted(choices))}"
    return ConfigError("", path=where, template=f"unknown key {key!r} in {ConfigError.PATH}{hint}", root=root)


# --------------------------------------------------------------------------------------------------------------
# Generic dataclass machinery
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations (from __future__ import annotations) in cls's module.
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _init_params(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
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


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the annotation `tp` and convert it to its canonical form (lists -> tuples,
    mappings -> dataclasses, ints -> floats). Raises ConfigError located at `path`."""
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _invalid(path, value, "expected null")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, where=path)
        raise _invalid(path, value, f"expected a mapping of {tp.__name__} keys, got {type(value).__name__}")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        errors = []
        for member in members:
            try:
                return _coerce(member, value, path)
            except ConfigError as err:
                errors.append(err)
        if len(members) == 1:
            # Optional[X]: X's own message (it lists Literal choices) is the most useful one.
            raise errors[0]
        raise _invalid(path, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        for choice in args:
            # `True == 1`, so compare types too: a Literal of strings must not accept a bool.
            if value == choice and type(value) is type(choice):
                return choice
        shown = ", ".join(repr(c) for c in args)
        raise _invalid(path, value, f"must be one of {shown}{_did_you_mean(value, [str(c) for c in args])}")
    if origin in (tuple, list, Sequence, typing.Sequence) or tp in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise _invalid(path, value, f"expected a list, got {type(value).__name__}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise _invalid(path, value, f"expected a list of exactly {len(args)} items")
            return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _invalid(path, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _invalid(path, value, f"expected an integer, got {type(value).__name__}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads `1e-3` (no dot) as a string; accept any text float() understands.
            try:
                return float(value)
            except ValueError:
                pass
        raise _invalid(path, value, f"expected a number, got {type(value).__name__}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _invalid(path, value, f"expected a string, got {type(value).__name__} (quote it in YAML)")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _invalid(path, value, f"expected {tp.__name__}, got {type(value).__name__}")
    raise TypeError(f"specjax.config cannot check values of type {tp!r} at {path!r}")


def _normalize(obj: Any) -> None:
    """Type-check and canonicalize every field of a frozen dataclass in place (for __post_init__)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = _coerce(hints[f.name], value, f.name)
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
    names, required = _init_params(cls)
    aliases = _aliases(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise _unknown_key(repr(key), where, cls.__name__, names)
        name = aliases.get(key, key)
        if name not in names:
            raise _unknown_key(key, where, cls.__name__, names)
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
            kwargs[name] = _coerce(tp, value, name)
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


def _deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`: mappings merge key by key, everything else (lists too) is replaced."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
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
    merged = _deep_merge(to_dict(cfg), _canonical_keys(cls, mapping))
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
                raise _unknown_key(part, ".".join(canonical), root_cls.__name__,
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
            node[leaf] = _deep_merge(node[leaf], value)
        else:
            node[leaf] = value
    return merge(cfg, patch)


# --------------------------------------------------------------------------------------------------------------
# YAML files
# --------------------------------------------------------------------------------------------------------------


def load_yaml_dict(path: str | pathlib.Path) -> dict[str, Any]:
    """A YAML config file as a dict, with `include:` resolved.

    `include: other.yaml` (or a list of files) names files relative to this one; they are merged in order and
    this file's own keys override theirs. An empty file is an empty mapping.
    """
    return _read_yaml(pathlib.Path(path), ())


def _read_yaml(path: pathlib.Path, stack: tuple[pathlib.Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in stack + (resolved,))
        raise ConfigError(f"{path}: include cycle ({chain}); remove one of the includes")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; check the path "
                          f"(packaged configs: {', '.join(available_configs())})")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{path}{where}: invalid YAML ({problem}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping of config keys, got {type(data).__name__}")
    data = dict(data)
    includes = data.pop("include", None)
    if includes is None:
        return data
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: 'include' must be a file name or a list of file names, got {includes!r}")
    base: dict[str, Any] = {}
    for inc in includes:
        inc_path = pathlib.Path(inc).expanduser()
        if not inc_path.is_absolute():
            inc_path = path.parent / inc_path
        base = _deep_merge(base, _read_yaml(inc_path, stack + (resolved,)))
    return _deep_merge(base, data)


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    """Load a YAML file (`yaml.safe_load`, `include:` resolved) into dataclass `cls`, strictly.
    Errors name the file."""
    data = load_yaml_dict(path)
    try:
        return from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _package_root() -> Optional[pathlib.Path]:
    try:
        root = importlib.resources.files("specjax.configs")
    except ModuleNotFoundError:
        return None
    path = root if isinstance(root, pathlib.Path) else pathlib.Path(str(root))
    return path if path.is_dir() else None


def available_configs() -> list[str]:
    """Names of the YAML configs shipped in `specjax.configs`, e.g. ['default', 'methods/ngram', ...]."""
    root = _package_root()
    if root is None:
        return []
    names = []
    for p in root.rglob("*"):
        if p.suffix in _YAML_SUFFIXES and p.is_file():
            names.append(p.relative_to(root).with_suffix("").as_posix())
    return sorted(names)


def packaged_config_path(name: str | pathlib.Path) -> pathlib.Path:
    """The file for a config name: 'methods/ngram' or 'methods/ngram.yaml' inside the installed
    `specjax.configs` package, else `name` as a filesystem path. Raises ConfigError listing the
    available names when neither exists."""
    text = str(name)
    root = _package_root()
    if root is not None and text:
        rel = text if text.endswith(_YAML_SUFFIXES) else text + ".yaml"
        candidate = (root / rel).resolve()
        # A name must not climb out of the package ('../secrets').
        if candidate.is_file() and candidate.is_relative_to(root.resolve()):
            return candidate
    path = pathlib.Path(text).expanduser()
    if text and path.is_file():
        return path
    avail = available_configs()
    stem = text[: -len(".yaml")] if text.endswith(".yaml") else text
    raise ConfigError(
        f"no config named {text!r}: not a packaged config and no such file{_did_you_mean(stem, avail)}; "
        f"available: {', '.join(avail) or '(none installed)'}")


# --------------------------------------------------------------------------------------------------------------
# The configs
# --------------------------------------------------------------------------------------------------------------


SPECULATIVE_METHODS = ("draft_model", "ngram", "suffix", "medusa", "eagle", "eagle3")


@dataclass(frozen=True)
class ModelConfig:
    """Which target model to run. `model` is a registry name (e.g. 'smollm2-135m') or a local path;
    `max_context` caps the KV cache length (None = the model's own limit)."""

    model: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_context: Optional[int] = None

    def __post_init__(self) -> None:
        _normalize(self)
        if not self.model.strip():
            raise _invalid("model", self.model, "must name a model; use e.g. 'smollm2-135m' or a local path")
        if self.max_context is not None and self.max_context < 1:
            raise _invalid("max_context", self.max_context,
                           "must be >= 1; use null for the model's own context length")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled; also specjax's public Python sampling API (vLLM style).

    `temperature=0` is greedy decoding. `top_k=0` and `top_p=1` switch those filters off. `max_tokens` is
    accepted as an input-only alias of `max_new_tokens`: `SamplingParams(temperature=0.7, max_tokens=64)`;
    read the value back as `max_new_tokens`.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: InitVar[Optional[int]] = None

    # Alternative key names accepted by from_dict / merge / apply_overrides (not a dataclass field).
    _config_aliases = types.MappingProxyType({"max_tokens": "max_new_tokens"})

    def __post_init__(self, max_tokens: Optional[int]) -> None:
        _normalize(self)
        if max_tokens is not None:
            max_tokens = _coerce(int, max_tokens, "max_tokens")
            default = SamplingParams.__dataclass_fields__["max_new_tokens"].default
            if self.max_new_tokens not in (default, max_tokens):
                raise _invalid("max_tokens", max_tokens,
                               f"conflicts with max_new_tokens={self.max_new_tokens}; give only one of them")
            object.__setattr__(self, "max_new_tokens", max_tokens)
        if self.max_new_tokens < 1:
            raise _invalid("max_new_tokens", self.max_new_tokens, "must be >= 1; ask for at least one token")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise _invalid("temperature", self.temperature,
                           "must be a finite number >= 0; use 0 for greedy decoding or e.g. 0.7 to sample")
        if self.top_k < 0:
            raise _invalid("top_k", self.top_k, "must be >= 0; use 0 to switch top-k filtering off")
        if not (0 < self.top_p <= 1):
            raise _invalid("top_p", self.top_p, "must be in (0, 1]; use 1.0 to switch nucleus sampling off")
        if self.seed < 0:
            raise _invalid("seed", self.seed, "must be >= 0; use a non-negative integer seed")
        for i, tok in enumerate(self.stop_token_ids):
            if tok < 0:
                raise _invalid(f"stop_token_ids[{i}]", tok, "token ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0

    @classmethod
    def from_user(cls, obj: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """None (defaults), a dict such as {"temperature": 0.7, "max_tokens": 64}, or an instance."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            return from_dict(cls, obj, where="sampling_params")
        raise ConfigError(f"sampling_params must be None, a dict or SamplingParams, got {type(obj).__name__}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM-compatible key names where vLLM has them).

    method: None (plain decoding) or one of SPECULATIVE_METHODS.
    num_speculative_tokens: gamma, tokens drafted per step (for medusa: the number of heads).
    model: draft model name/path (draft_model) or head checkpoint path (medusa / eagle / eagle3).
    prompt_lookup_min/max: n-gram sizes matched against the context (ngram). The minimum is 3 by default: on
        13 Spec-Bench prompts 1- and 2-token matches proposed more often and were accepted less (first-token
        acceptance 0.54 against 0.67 with min 3), so more verify steps were paid for fewer tokens
        (reports/spec_bench_cpu/lookup_tuning/).
    suffix_*: suffix-tree drafter limits (suffix).
    tree_choices: a static token tree as paths of top-k ranks, e.g. ((0,), (1,), (0, 0)); must be prefix-closed.
    top_k / depth / total_tokens: dynamic draft tree shape (eagle / eagle3).
    lookup_tokens: eagle / eagle3 / medusa: where the context holds an n-gram match (prompt_lookup_min/max), up
        to this many looked-up tokens become the first branch of the head's tree, in place of its last nodes
        (same node budget, so the same verify cost; `specjax.drafters.with_lookup`). 0 = the head alone.
    acceptance: 'lossless' (exact target distribution) or 'typical' (Medusa typical acceptance; lossy, see
        `is_lossy`); typical_posterior_* are its threshold and alpha.
    adaptive: per-sequence back-off (`spec_engine.Adaptive`): a sequence whose accepted tokens per verify step
        stay below the break-even measured on this hardware decodes plainly and probes again later;
        False = always speculate.
    """

    method: Optional[Literal["draft_model", "ngram", "suffix", "medusa", "eagle", "eagle3"]] = None
    num_speculative_tokens: int = 4
    model: Optional[str] = None
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 3
    suffix_max_depth: int = 24
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    tree_choices: Optional[tuple[tuple[int, ...], ...]] = None
    top_k: int = 8
    depth: int = 5
    total_tokens: int = 32
    lookup_tokens: int = 0
    acceptance: Literal["lossless", "typical"] = "lossless"
    typical_posterior_threshold: float = 0.09
    typical_posterior_alpha: float = 0.3
    adaptive: bool = True

    def __post_init__(self) -> None:
        _normalize(self)
        if self.num_speculative_tokens < 1:
            raise _invalid("num_speculative_tokens", self.num_speculative_tokens,
                           "must be >= 1 (tokens drafted per step); use method: null to switch speculation off")
        if self.method == "draft_model" and not self.model:
            raise _invalid("model", self.model,
                           "method 'draft_model' needs a draft model; set model to a model name or local path")
        if self.method is None and self.model is not None:
            raise _invalid("model", self.model,
                           "is set but method is null; set method (e.g. 'draft_model') or model: null")
        if self.model is not None and not self.model.strip():
            raise _invalid("model", self.model, "must not be empty; use null for no model")
        if self.prompt_lookup_min < 1:
            raise _invalid("prompt_lookup_min", self.prompt_lookup_min, "must be >= 1 (n-gram length)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _invalid("prompt_lookup_min", self.prompt_lookup_min,
                           f"must be <= prompt_lookup_max={self.prompt_lookup_max}; lower it or raise the max")
        if self.suffix_max_depth < 1:
            raise _invalid("suffix_max_depth", self.suffix_max_depth, "must be >= 1")
        if not (0 <= self.suffix_min_token_prob <= 1):
            raise _invalid("suffix_min_token_prob", self.suffix_min_token_prob, "must be in [0, 1]")
        if not (math.isfinite(self.suffix_max_spec_factor) and self.suffix_max_spec_factor > 0):
            raise _invalid("suffix_max_spec_factor", self.suffix_max_spec_factor, "must be a finite number > 0")
        for name in ("top_k", "depth", "total_tokens"):
            if getattr(self, name) < 1:
                raise _invalid(name, getattr(self, name), "must be >= 1 (draft tree shape)")
        if self.tree_choices is not None:
            _check_tree(self.tree_choices)
        if self.lookup_tokens < 0:
            raise _invalid("lookup_tokens", self.lookup_tokens, "must be >= 0 (0 = no lookup branch)")
        if self.lookup_tokens and self.method not in ("eagle", "eagle3", "medusa"):
            raise _invalid("lookup_tokens", self.lookup_tokens,
                           f"merges a lookup branch into a head's tree, so it needs method eagle, eagle3 or medusa "
                           f"(got {self.method!r}); for lookups alone use method 'ngram'")
        if not (0 < self.typical_posterior_threshold <= 1):
            raise _invalid("typical_posterior_threshold", self.typical_posterior_threshold, "must be in (0, 1]")
        if not (0 <= self.typical_posterior_alpha <= 1):
            raise _invalid("typical_posterior_alpha", self.typical_posterior_alpha, "must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        """True when a speculative method is selected."""
        return self.method is not None

    @property
    def is_lossy(self) -> bool:
        """True iff acceptance is 'typical': outputs may then differ from the target model's distribution."""
        return self.acceptance == "typical"

    @classmethod
    def from_user(cls, obj: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig":
        """None (no speculation), a vLLM-style dict such as
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, or an instance."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            return from_dict(cls, obj, where="speculative_config")
        raise ConfigError(
            f"speculative_config must be None, a dict or SpeculativeConfig, got {type(obj).__name__}")


def _check_tree(choices: tuple[tuple[int, ...], ...]) -> None:
    seen = set()
    for i, path in enumerate(choices):
        where = f"tree_choices[{i}]"
        if not path:
            raise _invalid(where, list(path), "tree paths must be non-empty lists of top-k ranks")
        if any(r < 0 for r in path):
            raise _invalid(where, list(path), "top-k ranks must be >= 0")
        if path in seen:
            raise _invalid(where, list(path), "duplicate tree path; list each node once")
        seen.add(path)
    for i, path in enumerate(choices):
        parent = path[:-1]
        if parent and parent not in seen:
            raise _invalid(f"tree_choices[{i}]", list(path),
                           f"its parent {list(parent)} is missing; every prefix of a path must be listed too")


@dataclass(frozen=True)
class BackendConfig:
    """Where to run. backend 'auto' picks the best available JAX platform; attention_impl names an attention
    kernel ('auto' = the backend's default)."""

    backend: Literal["auto", "cpu", "gpu", "tpu", "neuron"] = "auto"
    attention_impl: str = "auto"

    def __post_init__(self) -> None:
        _normalize(self)
        if not self.attention_impl.strip():
            raise _invalid("attention_impl", self.attention_impl, "must not be empty; use 'auto'")


@dataclass(frozen=True)
class RunConfig:
    """The command line's top-level config: one YAML file (configs/default.yaml) maps onto it. Sections left out
    of a YAML file keep their defaults, so a method file only needs its `speculative:` section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    batch_size: int = 1
    prompts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _normalize(self)
        if self.batch_size < 1:
            raise _invalid("batch_size", self.batch_size, "must be >= 1")


def load_run_config(config: Optional[str | pathlib.Path] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The CLI's config: packaged `default.yaml`, then `config` (a packaged name such as 'methods/ngram' or a
    file path) merged over it, then `key=value` overrides."""
    root = _package_root()
    default = root / "default.yaml" if root is not None else None
    cfg = load_yaml(RunConfig, default) if default is not None and default.is_file() else RunConfig()
    if config is not None:
        path = packaged_config_path(config)
        try:
            cfg = merge(cfg, load_yaml_dict(path))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    return apply_overrides(cfg, overrides)
