"""What every trainer shares: the optimizer, orbax checkpoints, the resumable metrics log.

The draft-model, Medusa and EAGLE trainers (`specjax.train.draft_model`, `.medusa`, `.heads`) differ in data and loss;
the training scaffolding below is one piece, so a resumed run behaves the same whichever head it trains.
"""
from __future__ import annotations

import json
import os


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
    """(AdamW with global-norm clipping over a warmup + cosine schedule ending at 5% of lr, the schedule)."""
    import optax

    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)), schedule


def checkpoint_manager(out: str, every: int):
    """An orbax manager for OUT/checkpoints keeping the last two, synchronous (a killed run loses at most
    `every` steps and never leaves a half-written latest checkpoint behind)."""
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
