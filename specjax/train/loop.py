"""The one training loop of every specjax trainer (draft model, EAGLE heads, Medusa heads).

A trainer supplies what differs: a pure update `(params, opt_state, frozen, batch) -> (params, opt_state,
metrics)` (usually `apply_gradients` on its loss), the batch of each step, how a step's metrics read in the log,
and its held-out evaluation. `fit` does the rest, the same way for all of them: jit the update once (params
and optimizer state donated), restore the last orbax checkpoint (a rerun of the same command resumes), run the
steps with a progress bar, log every step and evaluation to OUT/metrics.jsonl, evaluate every `eval_every`
steps and at the end, and checkpoint every `checkpoint_every` steps and at the end.

Also here: the optimizer (AdamW, warmup + cosine), the checkpoint manager, the metrics log, and the plotting
helpers the trainers' training curves share.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from specjax.train.common import TrainError, require_train_extra


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
    """(AdamW with global-norm clipping over a warmup + cosine schedule ending at 5% of lr, the schedule)."""
    require_train_extra()
    import optax

    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)), schedule


def apply_gradients(loss_fn: Callable, optimizer, params, opt_state, *args):
    """One optimizer step on `loss_fn(params, *args) -> (loss, aux)`. Returns (params, opt_state, aux); pure."""
    import optax

    grads, aux = jax.grad(loss_fn, has_aux=True)(params, *args)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux


def checkpoint_manager(out: str, every: int):
    """An orbax manager for OUT/checkpoints keeping the last two, synchronous (a killed run loses at most
    `every` steps and never leaves a half-written latest checkpoint behind)."""
    require_train_extra()
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")), options=options)


def read_metrics(path: str, upto: int) -> list[dict]:
    """Metrics logged up to step `upto` (a resumed run drops what was logged after its checkpoint)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if r["step"] <= upto]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


class LoopResult(NamedTuple):
    """What `fit` returns."""

    params: Any  # the trained params (the checkpoint's, for a run that was already finished)
    history: list[dict]  # every record of OUT/metrics.jsonl: {"kind": "train" | "eval", "step", ...}
    start: int  # the step this invocation resumed from (0 for a fresh run)
    seconds: float  # time spent in the training steps of this invocation


def fit(update: Callable, params, optimizer, schedule, frozen, batch_at: Callable[[int], Any], *, out: str,
        steps: int, checkpoint_every: int, eval_every: int, record: Callable[[dict], dict],
        evaluate: Callable[[Any, int, bool], dict | None] | None = None,
        describe: Callable[[dict], str] | None = None, show: Sequence[str] = ("loss",), progress: bool = True,
        desc: str = "train", lr: float | None = None, params_key: str = "params",
        error: type[Exception] = TrainError, stop_at: int | None = None) -> LoopResult:
    """Train `params` for `steps` steps in run directory `out`, resuming from its last checkpoint.

    update: pure (params, opt_state, frozen, batch) -> (params, opt_state, metrics); jitted here once.
    frozen: arrays every step reads and nothing trains (passed as an argument, not baked into the program).
    batch_at(step): the batch of step `step` (0-based); a pure function of the step, so a resumed run sees the
    same batches. record(metrics): the step's metrics (host arrays) as a log entry; it must hold a finite
    "loss". evaluate(params, step, final): a held-out evaluation record, or None (no held-out data); run at
    step 0 of a fresh run, every `eval_every` steps and at the last (final=True). describe(eval record): the
    line the progress bar prints after an evaluation. show: record entries on the bar (smoothed).
    params_key: the checkpoint's name for the params. error: raised when the loss becomes NaN or infinite.
    stop_at: end this invocation after that step (checkpointed, with a final evaluation) while the schedule
    stays the one of `steps`: a long run can be cut into sessions, and rerunning without it goes on to `steps`.
    """
    require_train_extra()
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    step_fn = jax.jit(update, donate_argnums=(0, 1))
    opt_state = optimizer.init(params)
    mngr = checkpoint_manager(out, checkpoint_every)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {params_key: params, "opt": opt_state})
        restored = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored[params_key], restored["opt"]
    metrics_path = os.path.join(out, "metrics.jsonl")
    history = read_metrics(metrics_path, start)
    end = steps if stop_at is None else min(stop_at, steps)
    if start > end:
        raise error(f"{out} is already at step {start}, past --stop-at {stop_at}; stop at a later step or drop "
                    "--stop-at")

    def log(rec):
        history.append(rec)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def run_eval(step, final):
        ev = evaluate(params, step, final) if evaluate is not None else None
        if ev is not None:
            log({"kind": "eval", "step": step, "final": bool(final), **ev})
        return ev

    if start == 0 and not any(r["kind"] == "eval" for r in history):
        run_eval(0, False)
    bar = tqdm(total=steps, initial=start, desc=desc, unit="step", disable=not progress)
    ema: dict[str, Any] = {}
    t0 = time.perf_counter()
    for step in range(start, end):
        params, opt_state, m = step_fn(params, opt_state, frozen, batch_at(step))
        rec = record(jax.device_get(m))
        if not math.isfinite(rec["loss"]):
            raise error(f"loss became {rec['loss']} at step {step + 1}; lower --lr (now {lr})")
        done = step + 1
        log({"kind": "train", "step": done, **rec, "lr": float(schedule(step)),
             "seconds": round(time.perf_counter() - t0, 2)})
        bar.update(1)
        for k in show:
            v = np.asarray(rec[k], np.float64)
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        bar.set_postfix({k: _fmt(v) for k, v in ema.items()})
        if done % eval_every == 0 or done == end:
            ev = run_eval(done, done == end)
            if ev is not None and describe is not None:
                bar.write(f"step {done}: {describe(ev)}")
        mngr.save(done, args=ocp.args.StandardSave({params_key: params, "opt": opt_state}), force=done == end)
    bar.close()
    mngr.wait_until_finished()
    # A run killed between its last checkpoint and its last evaluation (or stopped at a checkpoint by a rerun
    # with --stop-at) has no final evaluation yet.
    if start == end and not any(r["kind"] == "eval" and r["step"] == end and r.get("final") for r in history):
        run_eval(end, True)
    return LoopResult(params, history, start, time.perf_counter() - t0)


def add_loop_options(ap, *, checkpoint_every: int, eval_every: int, eval_batch: int) -> None:
    """The command-line options `fit` reads in every trainer: checkpoint and evaluation cadence, the seed of
    the batch order and initialisation, and the progress bar switch (each trainer picks its defaults)."""
    ap.add_argument("--checkpoint-every", type=int, default=checkpoint_every)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--eval-batch", type=int, default=eval_batch)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-at", type=int, default=None,
                    help="end this invocation after step N (checkpointed, evaluated and exported) with the schedule "
                         "of --steps unchanged; rerun without it to go on")
    ap.add_argument("--no-progress", dest="progress", action="store_false")


def report(summary: dict, hide: Sequence[str] = ("data_meta",)) -> dict:
    """Print a run's summary as JSON (without the `hide` entries) for the command line; return it whole."""
    print(json.dumps({k: v for k, v in summary.items() if k not in hide}, indent=1))
    return summary


def _fmt(v: np.ndarray) -> str:
    return f"{float(v):.3f}" if v.ndim == 0 else "/".join(f"{a:.2f}" for a in v)


# ============================================================================================ summaries, curves
def last_eval(history: list[dict]) -> dict | None:
    """The latest evaluation record, or None."""
    return next((r for r in reversed(history) if r["kind"] == "eval"), None)


def train_mean(history: list[dict], key: str, last: int = 50):
    """Mean of `key` over the last `last` training records (a float, or a list for per-head entries); None if
    there are none."""
    recs = [r[key] for r in history if r["kind"] == "train"][-last:]
    if not recs:
        return None
    mean = np.mean(np.asarray(recs, np.float64), axis=0)
    return float(mean) if mean.ndim == 0 else mean.tolist()


def split_history(history: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records)."""
    return [r for r in history if r["kind"] == "train"], [r for r in history if r["kind"] == "eval"]


def smoothed(recs: list[dict], values, points: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, moving average of `values`) over training records, the window sized to leave ~`points` points."""
    steps = np.asarray([r["step"] for r in recs])
    w = max(1, len(recs) // points)
    return steps[w - 1:], np.convolve(np.asarray(values, np.float64), np.ones(w) / w, mode="valid")


def pyplot_or_none(path: str):
    """matplotlib.pyplot on the Agg backend, or None (with a note naming the missing extra) when matplotlib is
    absent: a finished training run must not fail at its last step over a plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install 'specjax[plots]'): no training curves at {path}")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, axes, path: str, dpi: int = 90, **legend) -> None:
    """Grid and legend on every axis, then the figure to a PNG at `path` (its folder created) and closed."""
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(**legend)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
