"""The two speculation figures, pinned with hand-computed counts wherever they are reported.

* tau (mean accepted length) = 1 + accepted / verify steps, the papers' and vLLM's definition: plain (backed-off)
  steps do not count. The issue's record (4 drafted and 4 accepted in 1 verify step, then 26 plain steps) reads
  5.0, not 1.15.
* tokens per target forward = (accepted + decoding forwards) / decoding forwards, prefill excluded: plain steps
  count. The same record reads 31 / 27.
* Both are 1.0 without any step; `spec_metrics` (RequestOutput.metrics), the batch job's summary and the cost
  model all give these values; a check that pins them fails when the two are swapped.
* `generate --compare` reports the speedup over the mean of two plain runs with the speedup against each, and
  warns instead of claiming a speedup when nothing was accepted.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from specjax import requests
from specjax.cli.main import compare_lines
from specjax.runners.batch_io import JobSummary
from specjax.tools import cost_model

# The issue's record: 4 drafted, 4 accepted in 1 verify step, 26 plain steps (27 decoding forwards + prefill).
DRAFTED, ACCEPTED, VERIFY, PLAIN = 4, 4, 1, 26
TAU = 5.0  # 1 + 4 / 1
PER_FORWARD = 31 / 27  # (4 + 27) / 27


def pinned(tau: float, per_forward: float) -> None:
    assert tau == pytest.approx(TAU)
    assert per_forward == pytest.approx(PER_FORWARD)


def test_helpers_on_the_issue_record_and_without_steps():
    pinned(requests.tau(ACCEPTED, VERIFY), requests.tokens_per_forward(ACCEPTED, VERIFY + PLAIN))
    assert requests.tau(3, 2) == pytest.approx(2.5)
    assert requests.tokens_per_forward(3, 6) == pytest.approx(1.5)
    assert requests.tau(0, 0) == 1.0 and requests.tokens_per_forward(0, 0) == 1.0
    assert requests.tau(0, 5) == 1.0  # verify steps that accepted nothing: one token each


def fake_stats(rows: list[tuple[int, int, int, int]]):
    """SpecStats-like host arrays from (drafted, accepted, verify steps, plain steps) per row, depth 4."""
    d, a, v, p = (np.asarray(x) for x in zip(*rows))
    pos_d = np.zeros((len(rows), 4), np.int32)
    pos_a = np.zeros((len(rows), 4), np.int32)
    for i, (drafted, accepted, _, _) in enumerate(rows):
        pos_d[i, :drafted] = 1
        pos_a[i, :accepted] = 1
    return types.SimpleNamespace(drafted=d, accepted=a, verify_steps=v, plain_steps=p, pos_drafted=pos_d,
                                 pos_accepted=pos_a)


def test_request_metrics_carry_both_figures():
    stats = fake_stats([(DRAFTED, ACCEPTED, VERIFY, PLAIN), (0, 0, 0, 9)])
    m = requests.spec_metrics(stats, 0, None, None, lossy=False)
    pinned(m["mean_accepted_length"], m["tokens_per_forward"])
    assert m["verify_steps"] == 1 and m["target_forwards"] == 28  # prefill + 27 decoding forwards
    with pytest.raises(AssertionError):  # the old meaning in the tau field, and vice versa, is caught
        pinned(m["tokens_per_forward"], m["mean_accepted_length"])
    backed_off = requests.spec_metrics(stats, 1, None, None, lossy=False)
    assert backed_off["mean_accepted_length"] == 1.0 and backed_off["tokens_per_forward"] == 1.0
    tok = types.SimpleNamespace(decode=lambda ids: "")
    out = requests.build_output(tok, "p", [1, 2], list(range(31)), 0, 0.1, 1.0, **m)
    pinned(out.metrics.mean_accepted_length, out.metrics.tokens_per_forward)


def test_batch_job_summary():
    s = JobSummary(drafted=DRAFTED, accepted=ACCEPTED, verify_steps=VERIFY, plain_steps=PLAIN, speculative=True)
    pinned(s.tau, s.tokens_per_forward)
    text = s.format()
    assert "tau 5.00 (1 verify steps)" in text and "1.15 tokens per target forward" in text
    assert JobSummary().tau == 1.0 and JobSummary().tokens_per_forward == 1.0


def test_cost_model_uses_tau():
    acc = cost_model.Acceptance(accepted=ACCEPTED, drafted=DRAFTED, verify_steps=VERIFY, plain_steps=PLAIN)
    assert acc.expected_tokens == pytest.approx(TAU)  # per verify step: plain steps are priced separately
    assert cost_model.Acceptance().expected_tokens == 1.0
    assert cost_model.expected_tokens(np.asarray([3, 2, 1]), steps=4, gamma=2) == pytest.approx(1 + 5 / 4)


def test_compare_reports_the_spread_of_the_plain_runs():
    lines = compare_lines(spec_tps=120.0, plain_before_tps=90.0, plain_after_tps=110.0, drafted=40, accepted=20,
                          verify_steps=10)
    assert len(lines) == 1
    assert lines[0].startswith("speedup over plain decoding: 1.20x")  # against the mean, 100 tok/s
    assert "mean of 90.0 before and 110.0 after: 1.33x and 1.09x" in lines[0]


@pytest.mark.parametrize("drafted, verify_steps, why", [
    (40, 6, "0 of 40 drafted tokens accepted in 6 verify steps"),
    (0, 7, "no token drafted in 7 verify steps"),
    (0, 0, "no verify step ran"),
])
def test_compare_warns_when_nothing_was_accepted(drafted, verify_steps, why):
    lines = compare_lines(116.0, 100.0, 100.0, drafted=drafted, accepted=0, verify_steps=verify_steps)
    assert lines[0].startswith("WARNING: the method accepted nothing") and why in lines[0]
    assert not any(line.startswith("speedup") for line in lines)
    assert "1.16x" in lines[1] and "not a speedup" in lines[0]


@pytest.mark.slow
def test_generate_compare_on_a_tiny_model(tmp_path, capsys):
    """`specjax generate --compare` end to end: per-prompt tau and tokens per forward, then a verdict line."""
    from helpers import save_hf_model, tiny_config, tiny_params
    from specjax.cli.main import main

    cfg = tiny_config(architecture="LlamaForCausalLM")
    model = save_hf_model(tmp_path / "model", cfg, tiny_params(cfg, seed=3))
    assert main(["generate", "--model", str(model), "--method", "ngram", "-k", "3", "-n", "8", "-t", "0", "--raw",
                 "--compare", "the cat the cat the"]) == 0
    out = capsys.readouterr().out
    assert "mean accepted length tau" in out and "tokens per target forward" in out
    verdict = [line for line in out.splitlines() if line.startswith(("speedup over plain", "WARNING", "tok/s ratio"))]
    assert verdict and "before and" in verdict[-1] and "after" in verdict[-1]
    assert "output identical to plain: True" in out
