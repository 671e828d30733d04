"""A separate, smaller Llama-family draft model proposing a chain of gamma sampled (or greedy) tokens.

The draft keeps its own KV cache in `dstate`. Its committed length is derived from the target's every step
(target length - 1), and the first draft forward of a step feeds the last two tokens of the history: that
rewrites one entry that may already be there (same value) and covers the case where every draft token was
accepted and the last one never went through the draft. So rejections need no cache repair at all.

Backed off (the engine decodes plainly), the draft does not run a forward per token: `dstate.lengths` records
how many leading entries of the draft cache hold committed tokens, and the tokens decoded since then, all in the
history, go through the draft `catch_up` at a time before the next proposal. A forward over 16 tokens costs
about what one over a single token does on a CPU, where the per-token forwards cost 5-10% of a plain step.
`observe_plain` writes nothing then: the engine calls it in the other branch of the `lax.cond` whose draft
branch writes the cache, and a buffer written in place in both branches was copied whole at every speculative
step (2 buffers per draft layer). Where the compile policy has no `lax.cond` (Neuron) every plain step is
observed at once.

Optional reduced draft vocabulary: with `d2t` [Vd] (draft index -> target id) the draft's LM head covers Vd
tokens only, and its full-vocabulary q puts zero mass elsewhere (the acceptance rule is lossless for any q).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
        B = start.shape[0]
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

    def propose(self, dparams, dstate, ctx: DraftContext):
        c, g = self.config, self.num_speculative_tokens
        params = dparams["params"]
        B = ctx.last_token.shape[0]
        L = ctx.lengths
        u = uniforms(ctx.sampling.seed, ctx.step, (g,), stream=DRAFT_STREAM)  # [B, g]
        cache = dstate._replace(lengths=self._synced(dstate, L))
        if ctx.allow_cond and self.catch_up:
            # Tokens decoded plainly since the draft last ran (back-off), in chunks, up to L - 1.
            cache = jax.lax.while_loop(lambda c: jnp.any(c.lengths < L - 1),
                                       lambda c: self._catch_up_chunk(dparams, c, ctx, L - 1), cache)
        prev = jnp.take_along_axis(ctx.history, jnp.maximum(L - 1, 0)[:, None], axis=1)[:, 0]
        toks = jnp.stack([prev, ctx.last_token], axis=1)
        pos = jnp.stack([L - 1, L], axis=1)
        cache = cache._replace(lengths=L - 1)
        out = forward(params, c, toks, pos, cache, logit_positions=jnp.ones((B, 1), jnp.int32))
        q0, s0 = self._q(dparams, out.logits[:, 0], ctx.sampling, ctx.allow_cond)
        x0 = self._to_target(dparams, sample(s0, u[:, 0]).astype(jnp.int32))
        cache = out.cache._replace(lengths=L + 1)

        def body(carry, uk):
            cache, x = carry
            o = forward(params, c, x[:, None], cache.lengths[:, None], cache)
            qk, sk = self._q(dparams, o.logits[:, 0], ctx.sampling, ctx.allow_cond)
            xk = self._to_target(dparams, sample(sk, uk).astype(jnp.int32))
            return (o.cache._replace(lengths=cache.lengths + 1), xk), (xk, qk)

        (cache, _), (xs, qs) = jax.lax.scan(body, (cache, x0), u[:, 1:].T)
        drafted = jnp.concatenate([x0[:, None], xs.T], axis=1)  # [B, g]
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, g, V]: q[:, i] drew node i+1
        q = jnp.concatenate([q, q[:, -1:]], axis=1)  # the leaf's row is never read
        tokens = jnp.concatenate([ctx.last_token[:, None], drafted], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, g + 1))
        return Proposal(tokens, parents, jnp.ones((B, g + 1), bool), q), cache
