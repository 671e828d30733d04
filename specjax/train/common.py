"""Small pieces every trainer and the data generator share: the error base, the run-settings guard, the output
vocabulary choice, cached arrays and progress bars.

Imports go one way: the trainers (`draft_model`, `eagle`, `medusa`) use this module, `loop`, `features` and `data`;
this module imports none of them.
"""
from __future__ import annotations

import importlib
import json
import os
from typing import Callable

import numpy as np

from specjax.errors import SpecjaxError


class TrainError(SpecjaxError, ValueError):
    """A training run cannot start or continue as asked; the message says how to fix it."""


# The packages of the `train` extra that a core (inference-only) install lacks.
TRAIN_EXTRA = ("optax", "orbax.checkpoint")


def require_train_extra() -> None:
    """Raise TrainError, naming the install command, unless the `train` extra's packages import."""
    missing = []
    for name in TRAIN_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name.split(".")[0])
    if missing:
        raise TrainError(f"training needs {' and '.join(missing)}, which the core install leaves out; install the "
                         'training extra: pip install -e ".[train]" (from a checkout) or pip install "specjax[train]"')


def check_run(out: str, run: dict, error: type[Exception] = TrainError) -> None:
    """Create OUT and record the run's settings in OUT/run.json; raise `error` if OUT holds a run with others.

    run: the settings that decide what is trained (JSON-able values, in a stable order). A rerun with the same
    settings resumes; with other ones it would mix two runs' checkpoints, so it stops instead.
    """
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "run.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), v) for k, v in run.items() if old.get(k) != v}
        if diff:
            raise error(f"{out} holds a run with other settings {diff} (old, new); resume with the same arguments "
                        "or pick a new --out")
    with open(path, "w") as f:
        json.dump(run, f, indent=2)


def always_ids(meta: dict) -> list[int]:
    """Token ids every output vocabulary keeps: the first three specials and the data's stop tokens."""
    return sorted({0, 1, 2, *meta.get("stop_token_ids", [])})


def select_vocab(arrays: dict, size: int, vocab_size: int, always=(0, 1, 2), rows=None,
                 what: str = "draft vocabulary size") -> np.ndarray:
    """The `size` target ids a draft or head predicts, ascending.

    Ranked by how often each token is the target's output in the data: the emitted response tokens plus the
    probability mass of the target's top-k at every response step (rows: which sequences to count; default
    all). `always` (special and stop tokens) is kept whatever its count. When the data names fewer than
    `size` tokens, the rest are the lowest unused ids: byte-level BPE numbers merges in training order, so
    low ids are the generic, frequent pieces. what: how the error message names `size`.
    """
    if not len(always) <= size <= vocab_size:
        raise TrainError(f"{what} {size} must lie in [{len(always)}, {vocab_size}]")
    rows = np.arange(arrays["tokens"].shape[0]) if rows is None else np.asarray(rows)
    score = np.zeros(vocab_size, np.float64)
    R = arrays["topk_ids"].shape[1]
    for n in rows:
        p, k = int(arrays["prompt_len"][n]), int(arrays["length"][n] - arrays["prompt_len"][n])
        np.add.at(score, arrays["tokens"][n, p:p + k], 1.0)
        steps = np.arange(R) < k
        np.add.at(score, arrays["topk_ids"][n][steps].ravel(),
                  np.exp(arrays["topk_logp"][n][steps].astype(np.float64)).ravel())
    score[list(always)] = np.inf
    # Stable ranking: score descending, then id ascending (so unseen tokens come in id order).
    order = np.lexsort((np.arange(vocab_size), -score))
    return np.sort(order[:size]).astype(np.int32)


def cached_array(path: str, make: Callable[[], np.ndarray]) -> np.ndarray:
    """The array saved at `path` (.npy), or `make()` saved there first: a resumed run keeps its first choice."""
    if os.path.exists(path):
        return np.load(path, allow_pickle=False)
    arr = make()
    np.save(path, arr)
    return arr


def progress_bar(it, enabled: bool, **kw):
    """`it` under a tqdm bar when enabled, else `it` itself (tqdm is imported only when a bar is shown)."""
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, **kw)


def derived_seed(*parts: int) -> int:
    """A uint32 sampling seed that is a function of `parts` only (a run seed and a request's identity), so a
    request's sample depends neither on its batch nor on the order the engine runs it in."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint32)[0])


def pad_rows(seqs: list[np.ndarray], rows: int, multiple: int = 64, width: int | None = None) -> np.ndarray:
    """Token sequences right-padded with zeros into [rows, T] int32 (rows >= len(seqs)), T their longest length
    rounded up to `multiple` (at most `width`): one compiled shape per bucket for a teacher-forced forward."""
    T = -(-max(len(s) for s in seqs) // multiple) * multiple
    out = np.zeros((rows, T if width is None else min(T, width)), np.int32)
    for r, s in enumerate(seqs):
        out[r, :len(s)] = s
    return out
