"""`specjax train-head --config FILE`: run one of the trainers from a YAML file in the one config system.

The YAML has one top-level key, `train`, holding `kind` (draft | medusa | eagle | eagle3) and the trainer's
options under their command-line names with dashes as underscores (`features_cache`, `draft_vocab`, ...):

    train:
      kind: eagle3
      data: runs/data/smollm2_distill.npz
      out: runs/eagle3
      steps: 250

Keys are checked against the chosen trainer's own options before anything runs: an unknown key is an error that
suggests the closest valid one, so a typo never silently falls back to a default. `--set key=value` overrides
apply on top (`--set steps=10`). The trainer then runs exactly as `python -m specjax.train.<module> ...` would,
which is also the command printed first so a run can be reproduced without the YAML.
"""
from __future__ import annotations

import argparse
import importlib
import shlex
from typing import Any, Mapping, Sequence

import yaml

from specjax.config import ConfigError, did_you_mean, load_yaml_dict, packaged_config_path
from specjax.train.common import require_train_extra

TRAINERS = {"draft": "specjax.train.draft_model", "medusa": "specjax.train.medusa", "eagle": "specjax.train.eagle",
            "eagle3": "specjax.train.eagle"}


def _options(module) -> dict[str, argparse.Action]:
    """dest -> action of a trainer's parser (help excluded)."""
    return {a.dest: a for a in module.build_parser()._actions if a.dest != "help"}


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def to_argv(train: Mapping[str, Any], where: str = "train") -> tuple[str, list[str]]:
    """(module name, argv) for a `train:` mapping; raises ConfigError naming the bad key or value."""
    if not isinstance(train, Mapping):
        raise ConfigError(f"{where}: must be a mapping with 'kind' and the trainer's options")
    kind = train.get("kind")
    if kind not in TRAINERS:
        raise ConfigError(f"{where}.kind: {kind!r} is not a trainer{did_you_mean(kind, list(TRAINERS))}; "
                          f"choose one of {', '.join(TRAINERS)}")
    module_name = TRAINERS[kind]
    options = _options(importlib.import_module(module_name))
    argv: list[str] = []
    if "kind" in options:  # the EAGLE trainer serves both kinds
        argv += ["--kind", kind]
    for key, value in train.items():
        if key == "kind":
            continue
        dest = key.replace("-", "_")
        if dest not in options:
            raise ConfigError(f"{where}.{key}: unknown option for the {kind} trainer"
                              f"{did_you_mean(dest, sorted(options))}; valid: {', '.join(sorted(options))}")
        action = options[dest]
        flag = _flag(action)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{key}: must be true or false, got {value!r}")
            # store_true flags switch on, store_false flags (--no-progress) switch off.
            if value != action.default:
                argv.append(flag)
            continue
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        if action.nargs not in ("+", "*") and isinstance(value, (list, tuple)):
            values = [",".join(str(v) for v in value)]  # e.g. feature_layers: [1, 14, 26]
        argv += [flag, *(str(v) for v in values)]
    return module_name, argv


def _apply_sets(train: dict, sets: Sequence[str]) -> dict:
    out = dict(train)
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set steps=10")
        key, text = item.split("=", 1)
        key = key.strip().removeprefix("train.")
        out[key] = yaml.safe_load(text)
    return out


def main(config: str, sets: Sequence[str] = (), dry_run: bool = False) -> Any:
    """Run the trainer a YAML config names (a packaged name such as 'train/eagle' or a path)."""
    path = packaged_config_path(config)
    data = load_yaml_dict(path)
    unknown = [k for k in data if k != "train"]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r}{did_you_mean(unknown[0], ['train'])}; "
                          "a training config has one key, 'train'")
    if "train" not in data:
        raise ConfigError(f"{path}: missing the 'train' mapping (kind, data, out, ...)")
    module_name, argv = to_argv(_apply_sets(dict(data["train"]), sets), where=f"{path.name}: train")
    command = "python -m " + module_name + " " + shlex.join(argv)
    print(command, flush=True)
    if dry_run:
        return command
    require_train_extra()
    module = importlib.import_module(module_name)
    try:
        return module.main(argv)
    except SystemExit as exc:  # argparse rejected a value: its message is already printed
        raise ConfigError(f"{path}: the {data['train'].get('kind')} trainer rejected the options "
                          f"(see the message above)") from exc
