"""Config files: YAML (with `include:`) into dicts and dataclasses, and the configs shipped in `specjax.configs`.

    load_yaml_dict(path)                    a YAML file as a dict, `include:` resolved
    load_yaml(cls, path)                    a YAML file into dataclass `cls`, strictly
    available_configs()                     names of the packaged configs ('methods/ngram', ...)
    packaged_config_path("methods/ngram")   a YAML shipped in `specjax.configs`, else a filesystem path
"""
from __future__ import annotations

import importlib.resources
import pathlib
from collections.abc import Mapping
from typing import Any, Optional, TypeVar

import yaml

from specjax.config.machinery import ConfigError, deep_merge, did_you_mean, from_dict

__all__ = [
    "load_yaml",
    "load_yaml_dict",
    "packaged_config_path",
    "available_configs",
]

T = TypeVar("T")

_YAML_SUFFIXES = (".yaml", ".yml")


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
        base = deep_merge(base, _read_yaml(inc_path, stack + (resolved,)))
    return deep_merge(base, data)


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    """Load a YAML file (`yaml.safe_load`, `include:` resolved) into dataclass `cls`, strictly.
    Errors name the file."""
    data = load_yaml_dict(path)
    try:
        return from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def package_root() -> Optional[pathlib.Path]:
    try:
        root = importlib.resources.files("specjax.configs")
    except ModuleNotFoundError:
        return None
    path = root if isinstance(root, pathlib.Path) else pathlib.Path(str(root))
    return path if path.is_dir() else None


def available_configs() -> list[str]:
    """Names of the YAML configs shipped in `specjax.configs`, e.g. ['default', 'methods/ngram', ...]."""
    root = package_root()
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
    root = package_root()
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
        f"no config named {text!r}: not a packaged config and no such file{did_you_mean(stem, avail)}; "
        f"available: {', '.join(avail) or '(none installed)'}")

