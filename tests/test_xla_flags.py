"""`import specjax` turns on XLA:CPU's region analysis in copy insertion, and the speculative loop's compiled
program never copies the KV cache.

* The flag is added to XLA_FLAGS on import, kept when the user set it, and left out with SPECJAX_XLA_FLAGS=0.
* In the optimised HLO of `spec_loop` (tiny model, n-gram drafter, back-off on), no instruction copies a
  KV-cache-shaped buffer: both branches of the verify-or-plain cond leave the cache alone and the step writes the
  accepted K/V once after it. The same count on a loop whose attention backend needs the new tokens in the cache,
  written inside the branch, finds copies (XLA gives each branch its own operand tuple, and a buffer in both can
  be updated in place by only one), so the count can see what it is meant to. Each program is compiled in its own
  process: XLA reads the flags once.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

FLAG = "xla_cpu_copy_insertion_use_region_analysis"
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code: str, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "SPECJAX_XLA_FLAGS")}
    e.update(env)
    e["PYTHONPATH"] = HERE + os.pathsep + e.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def test_import_sets_the_flag_unless_told_not_to():
    code = "import os, specjax; print(os.environ.get('XLA_FLAGS', ''))"
    assert f"--{FLAG}=true" in _run(code)
    assert FLAG not in _run(code, SPECJAX_XLA_FLAGS="0")
    mine = f"--xla_cpu_enable_fast_math=false --{FLAG}=false"
    assert _run(code, XLA_FLAGS=mine) == mine


COUNT_COPIES = """
import os
import jax, jax.numpy as jnp
import specjax
from spec_helpers import tiny_config, tiny_params, tiny_llm
from specjax import engine, spec_engine
from specjax.buckets import make_buckets
from specjax.backoff import adaptive_rule
from specjax.runners.speculative import drafter_for
from specjax.requests import pad_prompts
from specjax.config import SamplingParams, SpeculativeConfig

config = tiny_config(64)
llm = tiny_llm(config, tiny_params(config, seed=0))
spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
drafter, dparams = drafter_for(llm, spec)
if os.environ.get("DRAFTER") == "draft_model":
    import dataclasses
    from specjax.drafters.draft_model import DraftModelDrafter
    # One KV head where the target has more: the draft's cache buffers have their own shape to count.
    dcfg = dataclasses.replace(config, num_layers=2, num_kv_heads=1)
    drafter = DraftModelDrafter(dcfg, 3, config.vocab_size)
    dparams = {"params": tiny_params(dcfg, seed=1)}
b = make_buckets(2, 12, 16, extra_slots=drafter.tree.num_nodes)
toks, lens, act = pad_prompts([[1, 2, 3, 1, 2, 3], [4, 5, 6, 4, 5]], b.batch, b.prompt_len)
sampling = llm.sampling_arrays([SamplingParams(max_new_tokens=16)] * 2, b.batch, b.num_stop)
st = spec_engine.spec_prefill(llm.params, llm.config, dparams, drafter, b, toks, lens, act, sampling)
attn = None
if os.environ.get("ATTENTION"):
    from specjax.backends.registry import get_attention
    attn = get_attention(os.environ["ATTENTION"], "cpu")
txt = spec_engine.spec_loop.lower(llm.params, llm.config, dparams, drafter, st, sampling, jnp.int32(8),
                                  attention_fn=attn, adaptive=adaptive_rule(drafter, spec),
                                  min_gain=jnp.float32(0.5)).compile().as_text()
shape = "f32[%d,%d,%d,%d]" % (b.batch, config.num_kv_heads, b.capacity, config.head_dim)
copies = sum(1 for line in txt.splitlines() if " copy(" in line and ("= " + shape) in line)
dshape = "f32[%d,1,%d,%d]" % (b.batch, b.capacity, config.head_dim)
dcopies = sum(1 for line in txt.splitlines() if " copy(" in line and ("= " + dshape) in line)
print(copies, 2 * config.num_layers, dcopies)
"""


@pytest.mark.slow  # two processes that compile the speculative loop (~40 s)
def test_spec_loop_never_copies_the_cache():
    copies, buffers, _ = map(int, _run(COUNT_COPIES).split())
    assert copies == 0, f"{copies} copies of KV-cache buffers ({buffers} buffers) per step"
    written_in_branch, _, _ = map(int, _run(COUNT_COPIES, ATTENTION="reference").split())
    assert written_in_branch > 0, "a cache written inside the cond's branch should be copied (else the count is blind)"


@pytest.mark.slow  # one process that compiles the speculative loop with a draft model (~30 s)
def test_spec_loop_never_copies_the_draft_models_cache():
    """The draft model's cache is written by the draft branch of the draft-or-back-off cond only: backed off,
    `observe_plain` defers the plain steps' tokens to the next proposal instead of writing them in the other
    branch (it did, and both draft cache buffers of every draft layer were copied at each speculative step)."""
    copies, _, dcopies = map(int, _run(COUNT_COPIES, DRAFTER="draft_model").split())
    assert (copies, dcopies) == (0, 0), f"{copies} target and {dcopies} draft KV-cache buffer copies"
