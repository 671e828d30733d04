"""The one training loop (`specjax.train.loop.fit`): --stop-at cuts a run into invocations without changing it."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.train.loop import apply_gradients, fit, make_optimizer
from specjax.train.common import TrainError


def _loss(params, frozen, batch):
    err = batch @ params["w"] - frozen["y"]
    return jnp.mean(err * err), {"loss": jnp.mean(err * err)}


def _run(out, stop_at=None, steps=6):
    optimizer, schedule = make_optimizer(0.05, steps, 2, 0.0, 1.0)
    frozen = {"y": jnp.arange(4.0)}

    def update(params, opt_state, frozen, batch):
        return apply_gradients(_loss, optimizer, params, opt_state, frozen, batch)

    evals = []

    def evaluate(params, step, final):
        evals.append((step, final))
        return {"w0": float(params["w"][0])}

    res = fit(update, {"w": jnp.zeros(3)}, optimizer, schedule, frozen,
              lambda k: jnp.asarray(np.random.default_rng(k).normal(size=(4, 3)), jnp.float32), out=str(out),
              steps=steps, checkpoint_every=100, eval_every=100, record=lambda m: {"loss": float(m["loss"])},
              evaluate=evaluate, progress=False, stop_at=stop_at)
    return res, evals


def test_stop_at_then_rerun_ends_where_an_uninterrupted_run_ends(tmp_path):
    whole, _ = _run(tmp_path / "whole")
    first, evals = _run(tmp_path / "cut", stop_at=3)
    assert evals[-1] == (3, True)  # the stopped invocation evaluates (and its caller exports) at its stop
    assert sum(r["kind"] == "train" for r in first.history) == 3
    again, evals = _run(tmp_path / "cut", stop_at=3)  # a rerun at the same stop trains nothing more
    assert again.start == 3 and evals == []
    np.testing.assert_array_equal(np.asarray(again.params["w"]), np.asarray(first.params["w"]))
    rest, evals = _run(tmp_path / "cut")
    assert rest.start == 3 and evals[-1] == (6, True)
    np.testing.assert_array_equal(np.asarray(rest.params["w"]), np.asarray(whole.params["w"]))
    assert not np.array_equal(np.asarray(first.params["w"]), np.asarray(whole.params["w"]))
    with pytest.raises(TrainError, match="already at step 6, past --stop-at 2"):
        _run(tmp_path / "cut", stop_at=2)
