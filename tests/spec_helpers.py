"""Shared helpers for the speculative-engine tests.

Tiny random Llama models (a 2-layer model compiles in seconds on CPU), a minimal `LLM` stand-in for them, drivers
that call the jitted engine entry points directly with explicit shape buckets (plain: prefill + decode_loop;
speculative: spec_prefill + spec_loop, or the host loop for host-side drafters), a top-2 logit gap for
explaining greedy divergences, and Pearson chi-square statistics for the sampling tests.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaincc

from specjax import engine, spec_engine
from specjax.api import LLM
from specjax.buckets import Buckets
from specjax.requests import pad_prompts
from specjax.runners.runtime import SUFFIX_GLOBAL_SEQS, SpecRuntime
from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward, param_shapes
from specjax.sampling import SamplingArrays

# A 2-layer, 4-head (2 KV heads) layout. Weights at scale 0.3 (not the usual 0.02) make attention sharp enough
# that RoPE positions and the KV cache contents change the argmax: a wrong position or a stale cache entry then
# shows up as a different greedy token instead of vanishing in near-uniform attention.
TINY_LAYOUT = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=1024)
TINY_SCALE = 0.3


def tiny_config(vocab_size: int, **overrides) -> LlamaConfig:
    kw = dict(TINY_LAYOUT, vocab_size=vocab_size)
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_params(config: LlamaConfig, seed: int, scale: float = TINY_SCALE, logit_scale: float = 1.0) -> dict:
    """Random float32 params (norm weights one, the rest N(0, scale^2)), drawn with NumPy: no per-shape JAX
    compiles. `logit_scale` multiplies the LM head (peakier or flatter next-token distributions)."""
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    params = jax.tree_util.tree_map_with_path(draw, param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
    if logit_scale != 1.0:
        key = "embed" if config.tie_word_embeddings else "lm_head"
        params[key] = params[key] * logit_scale
    return params


class StubTokenizer:
    """What `LLM` needs from a tokenizer when prompts are token ids: stop ids and decode."""

    def __init__(self, stop_token_ids: Sequence[int] = ()):
        self.stop_token_ids = tuple(stop_token_ids)

    def decode(self, ids) -> str:
        return " ".join(str(int(t)) for t in ids)

    def encode(self, text: str):
        raise AssertionError("tiny test models take token-id prompts only")


def tiny_llm(config: LlamaConfig, params: dict, *, max_context: int | None = None,
             stop_token_ids: Sequence[int] = ()) -> LLM:
    """An `LLM` around a tiny in-memory model (no files): prompts must be token-id lists."""
    llm = LLM.__new__(LLM)
    llm.model_spec = "tiny"
    llm.dtype = "float32"
    llm.config = config
    llm.params = params
    llm.tokenizer = StubTokenizer(stop_token_ids)
    llm.source = None
    llm.max_context = max_context or config.max_position_embeddings
    llm.backend = "cpu"
    llm.attention_impl = "reference"
    llm.attention_fn = None
    llm.runtime = SpecRuntime()
    return llm


def save_hf_llama(path: str, config: LlamaConfig, params: dict) -> str:
    """Write params as a Hugging Face Llama directory (config.json + model.safetensors, [out, in] weights)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
    t = {"model.embed_tokens.weight": a(params["embed"]), "model.norm.weight": a(params["final_norm"])}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = a(lp["attn_norm"])
        t[p + "post_attention_layernorm.weight"] = a(lp["mlp_norm"])
        for ours, theirs in names.items():
            t[p + theirs + ".weight"] = a(np.asarray(lp[ours]).T)
    if "lm_head" in params:
        t["lm_head.weight"] = a(np.asarray(params["lm_head"]).T)
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


# ---------------------------------------------------------------------------------------------- engine drivers


def _per_row(value, batch: int, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype)
    return np.broadcast_to(arr, (batch,)).copy() if arr.ndim == 0 else arr


def make_sampling(batch: int, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new=16,
                  stop_ids: Sequence[int] = (), num_stop: int = 4) -> SamplingArrays:
    """SamplingArrays for `batch` rows; every value is a scalar (all rows) or one value per row."""
    stops = np.full((batch, num_stop), -1, np.int32)
    stops[:, :len(stop_ids)] = list(stop_ids)
    return SamplingArrays(
        temperature=jnp.asarray(_per_row(temperature, batch, np.float32)),
        top_k=jnp.asarray(_per_row(top_k, batch, np.int32)),
        top_p=jnp.asarray(_per_row(top_p, batch, np.float32)),
        seed=jnp.asarray(_per_row(seed, batch, np.uint32)),
        max_new_tokens=jnp.asarray(_per_row(max_new, batch, np.int32)),
        stop_ids=jnp.asarray(stops),
    )


def tiny_buckets(batch: int, prompt_len: int = 16, max_new: int = 16, extra: int = 16) -> Buckets:
    return Buckets(batch, prompt_len, max_new, prompt_len + max_new + extra)


def outputs(dec: engine.DecodeState, n: int | None = None) -> tuple[list[list[int]], np.ndarray]:
    """(emitted tokens per row, finish codes [n]) of a finished decode state."""
    toks = np.asarray(dec.out_tokens)
    num = np.asarray(dec.num_new)
    n = toks.shape[0] if n is None else n
    return [toks[i, :num[i]].tolist() for i in range(n)], np.asarray(dec.finish)[:n]


def run_plain(params, config, buckets, ids: list[list[int]], sampling, width: int | None = None):
    """Plain decoding of token-id prompts. Returns the final DecodeState."""
    tokens, lens, active = pad_prompts(ids, buckets.batch, width or buckets.prompt_len)
    state = engine.prefill(params, config, buckets, tokens, lens, active, sampling)
    return engine.decode_loop(params, config, state, sampling, jnp.int32(2 ** 30))


def spec_start(params, config, dparams, drafter, buckets, ids: list[list[int]], sampling, width: int | None = None):
    """`spec_prefill` of token-id prompts (padded to `width`, default the bucket's prompt length)."""
    tokens, lens, active = pad_prompts(ids, buckets.batch, width or buckets.prompt_len)
    return spec_engine.spec_prefill(params, config, dparams, drafter, buckets, tokens, lens, active, sampling)


def run_spec(params, config, dparams, drafter, buckets, ids: list[list[int]], sampling, *, width: int | None = None,
             max_steps: int = 2 ** 30, adaptive=None, backed_off: bool = False):
    """Speculative decoding through the fused on-device loop. Returns the final SpecState.

    backed_off: start every row with a zero back-off gain (as if it had just backed off) instead of the
    optimistic seed, so an `adaptive` rule decodes plainly first."""
    state = spec_start(params, config, dparams, drafter, buckets, ids, sampling, width)
    if backed_off:
        state = state._replace(gain=jnp.zeros_like(state.gain))
    return spec_engine.spec_loop(params, config, dparams, drafter, state, sampling, jnp.int32(max_steps),
                                 adaptive=adaptive)


def run_suffix(params, config, drafter, buckets, ids: list[list[int]], sampling, global_index=None,
               width: int | None = None, adaptive=None):
    """Suffix decoding (host-side drafter) through `runners.speculative.host_loop`, as `LLM.generate` runs it.

    global_index: a SuffixIndex kept across calls (earlier outputs), or None for a fresh one.
    adaptive: the host loop's back-off rule (`backoff.Adaptive`), None = always speculate.
    Returns (final SpecState, global index)."""
    from specjax.runners import speculative
    from specjax.drafters.suffix import SuffixHostState
    from specjax.drafters.suffix_tree import SuffixIndex

    if global_index is None:
        global_index = SuffixIndex(drafter.max_depth, max_sequences=SUFFIX_GLOBAL_SEQS)
    state = spec_start(params, config, {}, drafter, buckets, ids, sampling, width)
    host = SuffixHostState(drafter, global_index, ids)
    stand_in = types.SimpleNamespace(params=params, config=config, attention_fn=None, runtime=SpecRuntime())
    state, _, _ = speculative.host_loop(stand_in, drafter, {}, state, sampling, len(ids), host, adaptive, "key")
    outs, _ = outputs(state.dec, len(ids))
    host.finish(outs, next(_SUFFIX_IDS))
    return state, global_index


_SUFFIX_IDS = itertools.count(10 ** 6, 10 ** 3)  # global-index sequence ids: unique across calls


# ---------------------------------------------------------------------------------------------- greedy divergence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token lists differ (a shorter list differs where it ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _logits_at_impl(params, config, tokens, pos):
    """Logits [V] of row 0 at position `pos` of tokens [1, T] (a fresh cache of capacity T)."""
    B, T = tokens.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    out = forward(params, config, tokens, positions, cache, logit_positions=jnp.full((B, 1), pos, jnp.int32))
    return out.logits[0, 0]


_logits_at = jax.jit(_logits_at_impl, static_argnames=("config",))


def last_logits(params, config: LlamaConfig, seq: Sequence[int]) -> np.ndarray:
    """Target logits [V] after the whole token sequence `seq` (one causal forward, padded to a power of two)."""
    n = len(seq)
    width = max(64, 1 << (n - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = seq
    return np.asarray(_logits_at(params, config, jnp.asarray(tokens), jnp.int32(n - 1)))


def top2_gap(logits: np.ndarray) -> float:
    """Largest minus second-largest logit (how far greedy decoding is from a tie)."""
    top = np.sort(np.asarray(logits, np.float64))[-2:]
    return float(top[1] - top[0])


# ---------------------------------------------------------------------------------------------- chi-square


def chi2_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed counts against probabilities, cells with small expectation pooled.

    counts and probs are flat arrays over the same cells. Returns (statistic, degrees of freedom); any count on
    a zero-probability cell gives an infinite statistic (the sampler emitted something impossible).
    """
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    if np.any(counts[probs == 0] > 0):
        return math.inf, 1
    nz = probs > 0
    expected = counts.sum() * probs[nz]
    observed = counts[nz]
    order = np.argsort(expected, kind="stable")
    groups_o, groups_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:  # smallest cells first: pool until each pooled cell expects >= min_expected
        acc_o += observed[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            groups_o.append(acc_o)
            groups_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        if groups_e:
            groups_o[-1] += acc_o
            groups_e[-1] += acc_e
        else:
            groups_o.append(acc_o)
            groups_e.append(acc_e)
    o, e = np.asarray(groups_o), np.asarray(groups_e)
    return float(np.sum((o - e) ** 2 / e)), max(len(o) - 1, 1)


def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (0 for an infinite statistic)."""
    if math.isinf(stat):
        return 0.0
    return float(gammaincc(jnp.float32(dof / 2), jnp.float32(stat / 2)))


def assert_greedy_speculation_equals_plain(method: str) -> None:
    """Greedy speculation on a tiny target equals plain greedy decoding, token for token, with at least one verify
    step: method "draft" (a 1-layer draft model, chains of 3) or "tree" (Medusa heads, an 8-node static tree).
    Used to check that a kernel policy set by the caller keeps speculation exact."""
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.medusa import MedusaDrafter
    from specjax.heads.medusa import MedusaConfig, draft_params, init_heads
    from specjax.models.llama import fuse_projections

    V = 96
    cfg = tiny_config(V)
    params = fuse_projections(tiny_params(cfg, seed=1))
    prompts = [[3, 9, 27, 81, 50, 11], [7, 7, 8]]
    buckets = tiny_buckets(2, max_new=20)
    sampling = make_sampling(2, max_new=20)
    plain, _ = outputs(run_plain(params, cfg, buckets, prompts, sampling))
    if method == "draft":
        dcfg = tiny_config(V, num_layers=1)
        drafter, dparams = DraftModelDrafter(dcfg, 3, V), {"params": fuse_projections(tiny_params(dcfg, seed=2))}
    else:
        hcfg = MedusaConfig(num_heads=3, hidden_size=cfg.hidden_size, vocab_size=V)
        heads = init_heads(hcfg, jax.random.PRNGKey(0), scale=0.5)
        tree = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))
        drafter, dparams = MedusaDrafter(hcfg, tree), draft_params(hcfg, heads, params)
    state = run_spec(params, cfg, dparams, drafter, buckets, prompts, sampling)
    spec, _ = outputs(state.dec)
    assert spec == plain
    assert int(np.asarray(state.stats.verify_steps).sum()) > 0
