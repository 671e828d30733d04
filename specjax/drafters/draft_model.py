"""A separate, smaller Llama-family draft model proposing a chain of up to gamma sampled (or greedy) tokens.

The draft keeps its own KV cache in `dstate`. Its committed length is derived from the target's every step
(target length - 1), and the first draft forward of a step feeds the last `window` tokens of the history, ending
at the root: the tokens the target accepted last step and its correction or bonus token enter the draft there,
in the forward that also gives the first draft logits (no catch-up pass while speculating). With the default
window of 2 that rewrites one entry that may already be there (same token) and covers the case where every draft
token was accepted and the last one never went through the draft; drafted tokens the target accepted are already
in the draft cache (the draft fed them to draw their successors). So rejections need no cache repair at all. A
drafter whose accepted tokens the draft never saw (the lookup chain of `with_lookup.DraftWithLookup`) widens the
window to cover them.

Backed off (the engine decodes plainly), the draft does not run a forward per token: `dstate.lengths` records
how many leading entries of the draft cache hold committed tokens, and the tokens decoded since then, all in the
history, go through the draft `catch_up` at a time before the next proposal's first forward. A forward over 16
tokens costs about what one over a single token does on a CPU, where the per-token forwards cost 5-10% of a plain
step. `observe_plain` writes nothing then: the engine calls it in the other branch of the `lax.cond` whose draft
branch writes the cache, and a buffer written in place in both branches was copied whole at every speculative
step (2 buffers per draft layer). Where the compile policy has no `lax.cond` (Neuron) every plain step is
observed at once.

Adaptive draft length (`dparams["p_min"]`, a traced scalar: tuning it compiles nothing): a row stops drafting at
the first token whose draft probability is below p_min, and that token is not proposed (llama.cpp's rule); the
draft forwards stop when no row drafts any more. The probability is the draft's softmax for greedy rows (whose
acceptance is exact for any proposal) and q itself for sampled rows, whose q is then the draft distribution
restricted to the tokens at or above p_min and renormalised: a token is proposed exactly when it was drawn from
that set, so it was drawn from the restricted q, and a row that stops samples its next token from the target
directly; either way the target distribution is kept.

Optional reduced draft vocabulary: with `d2t` [Vd] (draft index -> target id) the draft's LM head covers Vd
tokens only, and its full-vocabulary q puts zero mass elsewhere (the acceptance rule is lossless for any q that
is what was sampled). `trim_vocab` builds one from a ranked list of target ids (`specjax.drafters.draft_vocab`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftContext, DrafterBase, DrafterCapabilities, Proposal
from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward
from specjax.sampling import process_logits, sample, uniforms
from specjax.tree import TreeSpec, chain

DRAFT_STREAM = 2  # RNG stream of draft sampling, distinct from the target's


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(DrafterBase):
    config: LlamaConfig
    num_speculative_tokens: int = 4
    target_vocab_size: int = 0
    mode: str = "iid"
    features: tuple = ()
    catch_up: int = 16  # tokens per deferred draft forward while backed off (0 = observe every plain step)
    window: int = 2  # tokens of a step's first draft forward, ending at the root (see the module docstring)

    @property
    def tree(self) -> TreeSpec:
        return chain(self.num_speculative_tokens)

    @property
    def capabilities(self) -> DrafterCapabilities:
        return DrafterCapabilities(draft_config=self.config)

    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        c = self.config
        B, P = prompts.shape
        cache = init_cache(c.num_layers, B, capacity, c.num_kv_heads, c.head_dim, dparams["params"]["embed"].dtype)
        pos = jnp.broadcast_to(jnp.arange(P)[None], (B, P))
        out = forward(dparams["params"], c, prompts, pos, cache, compute_logits=False)
        return out.cache._replace(lengths=prompt_lens.astype(jnp.int32))

    def update(self, dparams, dstate, ctx, result):
        return dstate

    def observe_plain(self, dparams, dstate, ctx: DraftContext):
        """The target decodes ctx.last_token at position L without speculating. Eagerly (no `lax.cond`, or
        catch_up = 0): run it through the draft, so the draft cache keeps every committed entry below L. Deferred:
        nothing is written; the next `propose` runs the pending tokens, all in the history, through the draft."""
        L = ctx.lengths
        if not (ctx.allow_cond and self.catch_up):
            out = forward(dparams["params"], self.config, ctx.last_token[:, None], L[:, None],
                          dstate._replace(lengths=L), compute_logits=False)
            return out.cache
        return dstate._replace(lengths=self._synced(dstate, L))

    @staticmethod
    def _synced(dstate, L):
        """Leading draft cache entries that hold committed tokens [B]. A proposal leaves lengths past its drafted
        tokens; of those only the entries below the new L - 1 are committed (the accepted ones)."""
        return jnp.minimum(dstate.lengths, jnp.maximum(L - 1, 0))

    def _catch_up_chunk(self, dparams, cache, ctx: DraftContext, upto):
        """Run history tokens [lengths, lengths + catch_up) through the draft; lengths -> min(that, upto) [B].
        Entries written past `upto` hold no committed token; they lie past lengths and are rewritten later."""
        start = cache.lengths
        pos = start[:, None] + jnp.arange(self.catch_up, dtype=jnp.int32)[None]
        toks = jnp.take_along_axis(ctx.history, jnp.clip(pos, 0, ctx.history.shape[1] - 1), axis=1)
        out = forward(dparams["params"], self.config, toks, pos, cache, compute_logits=False)
        return out.cache._replace(lengths=jnp.minimum(start + self.catch_up, upto).astype(jnp.int32))

    def _q(self, dparams, logits, sampling, allow_cond: bool):
        """Draft logits [B, Vd] -> (q over the target vocabulary [B, V], sampling probs over the draft vocab)."""
        probs = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, allow_cond=allow_cond)
        d2t = dparams.get("d2t")
        if d2t is None:
            return probs, probs
        full = jnp.zeros(probs.shape[:-1] + (self.target_vocab_size,), probs.dtype).at[..., d2t].set(probs)
        return full, probs

    def _to_target(self, dparams, idx):
        d2t = dparams.get("d2t")
        return idx if d2t is None else jnp.take(d2t, idx)

    def _draw(self, dparams, logits, sampling, u, p_min, allow_cond: bool):
        """One drafted token per row from draft logits [B, Vd]: (token [B] target id, q [B, V] the acceptance
        uses, confidence [B] compared with p_min). See the module docstring for why q is restricted."""
        q, s = self._q(dparams, logits, sampling, allow_cond)
        idx = sample(s, u).astype(jnp.int32)
        x = self._to_target(dparams, idx)
        sampled = sampling.temperature > 0
        p_q = jnp.take_along_axis(q, x[:, None], axis=1)[:, 0]
        lg = logits.astype(jnp.float32)
        p_raw = jnp.exp(jnp.take_along_axis(lg, idx[:, None], axis=1)[:, 0] - jax.nn.logsumexp(lg, axis=-1))
        conf = jnp.where(sampled, p_q, p_raw)
        kept = jnp.where(q >= p_min, q, 0.0)
        kept = kept / jnp.maximum(jnp.sum(kept, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
        q = jnp.where(((p_min > 0) & sampled)[:, None], kept, q)
        return x, q, conf

    def propose(self, dparams, dstate, ctx: DraftContext, skip=None):
        """The Drafter step. skip [B] bool or None: rows that want no draft chain this step (their first forward
        still runs, keeping the draft cache in step); the chain's forwards stop once no row drafts."""
        c, g, W = self.config, self.num_speculative_tokens, self.window
        params = dparams["params"]
        B = ctx.last_token.shape[0]
        L = ctx.lengths
        p_min = jnp.asarray(dparams.get("p_min", 0.0), jnp.float32)
        u = uniforms(ctx.sampling.seed, ctx.step, (g,), stream=DRAFT_STREAM)  # [B, g]
        cache = dstate._replace(lengths=self._synced(dstate, L))
        start = jnp.maximum(L - (W - 1), 0)
        if ctx.allow_cond and self.catch_up:
            # Tokens decoded plainly since the draft last ran (back-off), in chunks, up to the first forward.
            cache = jax.lax.while_loop(lambda c: jnp.any(c.lengths < start),
                                       lambda c: self._catch_up_chunk(dparams, c, ctx, start), cache)
        # The first forward: committed tokens [start, L] (the root last), its logits at the root.
        pos = start[:, None] + jnp.arange(W, dtype=jnp.int32)[None]
        toks = jnp.take_along_axis(ctx.history, jnp.clip(pos, 0, ctx.history.shape[1] - 1), axis=1)
        out = forward(params, c, toks, pos, cache._replace(lengths=start), logit_positions=(L - start)[:, None])
        x0, q0, c0 = self._draw(dparams, out.logits[:, 0], ctx.sampling, u[:, 0], p_min, ctx.allow_cond)
        alive = c0 >= p_min
        if skip is not None:
            alive = alive & ~skip
        V = q0.shape[-1]
        drafted = jnp.zeros((B, g), jnp.int32).at[:, 0].set(x0)
        valid = jnp.zeros((B, g), bool).at[:, 0].set(alive)
        q = jnp.zeros((B, g + 1, V), q0.dtype).at[:, 0].set(q0)  # q[:, i] drew node i + 1; the leaf's row unread
        carry = (jnp.int32(1), out.cache._replace(lengths=L + 1), x0, alive, drafted, valid, q)

        def more(carry):
            k, alive = carry[0], carry[3]
            return (k < g) & jnp.any(alive)

        def body(carry):
            k, cache, x, alive, drafted, valid, q = carry
            o = forward(params, c, x[:, None], cache.lengths[:, None], cache)
            uk = jax.lax.dynamic_index_in_dim(u, k, axis=1, keepdims=False)
            xk, qk, ck = self._draw(dparams, o.logits[:, 0], ctx.sampling, uk, p_min, ctx.allow_cond)
            alive = alive & (ck >= p_min)
            drafted = jax.lax.dynamic_update_index_in_dim(drafted, xk, k, axis=1)
            valid = jax.lax.dynamic_update_index_in_dim(valid, alive, k, axis=1)
            q = jax.lax.dynamic_update_index_in_dim(q, qk, k, axis=1)
            return k + 1, o.cache._replace(lengths=cache.lengths + 1), xk, alive, drafted, valid, q

        if ctx.allow_cond:
            _, cache, _, _, drafted, valid, q = jax.lax.while_loop(more, body, carry)
        else:
            # Compile policies without data-dependent control flow (Neuron): a fixed trip count, every forward run.
            _, cache, _, _, drafted, valid, q = jax.lax.fori_loop(1, g, lambda _, c: body(c), carry)
        tokens = jnp.concatenate([ctx.last_token[:, None], drafted], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, g + 1))
        valid = jnp.concatenate([jnp.ones((B, 1), bool), valid], axis=1)
        return Proposal(tokens, parents, valid, q), cache


def trim_vocab(params: dict, d2t, keep_ids) -> tuple[dict, jax.Array]:
    """A draft's params with its LM head cut to the entries whose target id is in `keep_ids`, and the new d2t.

    params: a draft's params (LM head as `lm_head` [H, Vd], `lm_head_q` [Vd, H] quantized, or tied to `embed`);
    d2t: its draft index -> target id map [Vd] (None: the identity, a full-vocabulary draft); keep_ids: target ids
    to keep (any order). Entries keep their order, so d2t stays ascending when it was. The input embedding is
    untouched: the draft still reads every target token."""
    V = params["embed"].shape[0]
    cur = np.arange(V, dtype=np.int64) if d2t is None else np.asarray(d2t, np.int64)
    sel = np.flatnonzero(np.isin(cur, np.asarray(keep_ids, np.int64)))
    if sel.size == 0:
        raise ValueError("trim_vocab: none of keep_ids is in the draft's vocabulary")
    out = dict(params)
    idx = jnp.asarray(sel, jnp.int32)
    if "lm_head_q" in params:
        w = params["lm_head_q"]
        out["lm_head_q"] = dataclasses.replace(w, codes=w.codes[idx], scale=w.scale[idx],
                                               minimum=None if w.minimum is None else w.minimum[idx])
    elif "lm_head" in params:
        out["lm_head"] = jnp.take(params["lm_head"], idx, axis=1)
    else:
        out["lm_head"] = jnp.take(params["embed"], idx, axis=0).T
    return out, jnp.asarray(cur[sel], jnp.int32)
