"""NaN or infinite target logits (a corrupt checkpoint) are detected in every decode loop and never sampled from:
the row stops with finish_reason "error" and a NonFiniteLogitsWarning, keeping exactly the tokens plain decoding
emitted before the bad step (a verify pass may stop a little earlier, see below), and the healthy rows of the
same batch come out as they would alone.

The corruption is one token's embedding row set to NaN: a row that forwards that token gets NaN logits from
then on (causal attention carries it), other rows never see it. Poisoning a token the healthy greedy output
emits at its fourth step gives a row that fails mid-generation; a prompt that ends in the token fails at once.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.errors import NonFiniteLogitsWarning

from spec_helpers import tiny_config, tiny_llm, tiny_params

V = 96
PROMPTS = [[10, 11, 12, 10, 11, 12, 10], [30, 31, 32, 33], [50, 51]]
SP = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    """(clean llm, poisoned llm, poison token, clean greedy outputs)."""
    config = tiny_config(V)
    params = tiny_params(config, seed=3, logit_scale=3.0)
    clean = tiny_llm(config, params)
    want = [o.token_ids for o in clean.generate(PROMPTS, SP)]
    # A token the second prompt's greedy output emits at step 4 and no other prompt or output holds.
    others = set(PROMPTS[0] + PROMPTS[2] + want[0] + want[2] + PROMPTS[1])
    poison = next(t for t in want[1][3:] if t not in others and t not in want[1][:want[1].index(t)])
    bad = dict(params, embed=params["embed"].at[poison].set(np.nan))
    if "lm_head" not in params:
        pytest.skip("tiny models untie the LM head")
    poisoned = tiny_llm(config, bad)
    self_draft = SpeculativeConfig(method="draft_model", model="tiny-self", num_speculative_tokens=3, adaptive=False)
    poisoned.runtime.drafters[self_draft] = (DraftModelDrafter(config, 3, V), {"params": bad})
    return clean, poisoned, poison, want, self_draft


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_nonfinite_rows_stop_with_error_and_healthy_rows_are_untouched(models, method):
    clean, poisoned, poison, want, self_draft = models
    spec = {"plain": {"method": None}, "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                  prompt_lookup_min=1, adaptive=False),
            "draft_model": self_draft}[method]
    prompts = PROMPTS + [[60, poison]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = poisoned.generate(prompts, SP, speculative_config=spec)
    got = [o.outputs[0] for o in outs]
    assert [g.token_ids for g in (got[0], got[2])] == [want[0], want[2]]
    assert got[0].finish_reason == got[2].finish_reason == "length"
    k = want[1].index(poison)
    # Plain decoding emits the poisoned token (its logits came from clean tokens) and fails at the next step.
    # A verify pass that holds the poisoned token as a draft may fail earlier: the reference attention multiplies
    # masked-out values by a zero weight, and 0 x NaN is NaN, so the whole pass sees NaN. Either way the row keeps
    # a prefix of plain decoding's tokens and never samples from NaN.
    assert got[1].finish_reason == "error" and got[1].token_ids == want[1][:len(got[1].token_ids)]
    if method != "draft_model":  # n-gram never drafts the poisoned token here: it stops where plain stops
        assert got[1].token_ids == want[1][:k + 1]
    assert got[3].token_ids == [] and got[3].finish_reason == "error"  # NaN from the prefill on
    msgs = [str(w.message) for w in caught if issubclass(w.category, NonFiniteLogitsWarning)]
    assert len(msgs) == 2 and "NaN or infinite logits" in msgs[0]


def test_batch_job_records_the_error_and_finishes_the_rest(models, tmp_path):
    import json

    from specjax.runners.batch import run_job

    _, poisoned, poison, want, _ = models
    src = tmp_path / "in.jsonl"
    lines = [{"id": i, "prompt": p, "sampling": {"max_tokens": 12, "ignore_eos": True}}
             for i, p in enumerate(PROMPTS + [[60, poison]])]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    run_job(poisoned, str(src), str(out), batch_size=2, progress=False)
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs[0]["token_ids"] == want[0] and recs[2]["token_ids"] == want[2] and "error" not in recs[0]
    assert recs[1]["finish_reason"] == "error" and "NaN" in recs[1]["error"]
    assert recs[3]["finish_reason"] == "error" and recs[3]["token_ids"] == []
