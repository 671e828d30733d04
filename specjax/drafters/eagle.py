"""EAGLE drafters: a trained head on the target's features expands an EAGLE-2 dynamic draft tree (or a chain).

Per step (static shapes throughout):
  1. append: the `count` pairs the last verify step committed, (token after node i ; target feature of node i),
     padded to D + 1, are written into the head's own KV cache at positions [L - count, L) (L = committed target
     length). The head's cache length is therefore derived from the target's every step, so rejected draft
     entries need no repair: they lie at slots >= L and are overwritten.
  2. expand: the head's output at the last pair predicts the root's feature; its top_k tokens are level 1.
     Then `depth - 1` times: the top_k nodes of the newest level by cumulative score (the product of draft
     probabilities along the path, summed as log-probabilities) run through the head in one batch of top_k,
     with their ancestors' entries visible (tree attention inside the head's cache), and each contributes its
     top_k children: top_k * top_k new candidates, of which the best top_k are expanded next.
  3. select: the best `total_tokens` of all top_k + (depth - 1) * top_k^2 candidates by score. Scores never
     increase along a path, so this set is closed under taking parents; ranked by descending score (ties to the
     earlier candidate, and a parent always precedes its children) it is already in topological order with
     siblings by descending score.
The candidate set is a function of the context (top-k, no sampling), so acceptance uses the "deterministic"
rule, which is lossless under sampling too.

Backed off (the engine decodes plainly), the pairs are not appended one head forward per token: their target
features wait in a buffer of `catch_up` pairs (`EagleState`), which one head forward writes when it is full or
before the next proposal. A head forward over 16 pairs costs about what one over a single pair does on a CPU,
where the per-token appends cost 4-6% of a plain step. Where the compile policy has no `lax.cond` (Neuron)
every plain step is appended at once, as before.

With top_k = 1 the same code drafts a top-1 chain of `depth` tokens (`EagleDrafter.chain_of`).

dparams = {"head": head params (specjax.heads.eagle), "embed": target embedding [V, H], and for EAGLE-1/2 the
target's LM head: "lm_head" [H, V] when untied, "lm_head_q" when the target's LM head is quantized}. The target arrays are the target's own buffers (no copy).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftContext, DrafterBase, Proposal, find_packaged
from specjax.heads.eagle import HeadConfig, head_hidden, head_logits, init_head_cache, to_target_ids
from specjax.kv_cache import KVCache
from specjax.models.llama import dense_mask
from specjax.tree import TreeSpec, chain
from specjax.errors import SpecjaxError


class EagleState(NamedTuple):
    """The EAGLE drafter's state: the head's KV cache and the pairs waiting to go into it (back-off)."""

    cache: KVCache
    pend_feats: jax.Array  # [B, C, F] target features of the pending pairs, in position order
    pend_start: jax.Array  # [B] int32 position of the first pending pair
    pend_n: jax.Array  # [B] int32 pending pairs (0 = the cache is up to date)


class EagleDrafterError(SpecjaxError, ValueError):
    """An EAGLE drafter's tree settings are inconsistent; the message says which and how to fix them."""


@dataclasses.dataclass(frozen=True)
class EagleDrafter(DrafterBase):
    head: HeadConfig
    top_k: int = 8
    depth: int = 5
    total_tokens: int = 32  # drafted nodes per step (the tree holds total_tokens + 1 nodes with the root)
    mode: str = "deterministic"
    catch_up: int = 16  # pairs per deferred head forward while backed off (0 = append every plain step)

    def __post_init__(self):
        if min(self.top_k, self.depth, self.total_tokens) < 1:
            raise EagleDrafterError(f"top_k ({self.top_k}), depth ({self.depth}) and total_tokens "
                                    f"({self.total_tokens}) must all be >= 1")
        if self.total_tokens < self.depth:
            raise EagleDrafterError(f"total_tokens ({self.total_tokens}) must be >= depth ({self.depth}): the tree "
                                    "budget cannot hold one full-depth path; raise total_tokens or lower depth")
        if self.total_tokens > self.num_candidates:
            raise EagleDrafterError(
                f"total_tokens ({self.total_tokens}) exceeds the {self.num_candidates} candidates that top_k "
                f"{self.top_k} and depth {self.depth} generate (top_k + (depth - 1) * top_k^2); lower total_tokens "
                "or raise top_k")
        if self.catch_up < 0:
            raise EagleDrafterError(f"catch_up ({self.catch_up}) must be >= 0")
        if self.top_k > self.head.out_vocab:
            raise EagleDrafterError(f"top_k ({self.top_k}) exceeds the head's vocabulary ({self.head.out_vocab})")

    @classmethod
    def chain_of(cls, head: HeadConfig, gamma: int) -> "EagleDrafter":
        """The same head drafting a top-1 chain of gamma tokens (for side-by-side comparison with the tree)."""
        return cls(head, top_k=1, depth=gamma, total_tokens=gamma)

    @property
    def features(self) -> tuple:
        return self.head.features

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def tree(self) -> TreeSpec:
        # The node budget and the depth bound; per-step parents travel in the proposal.
        if self.top_k == 1:
            return chain(self.depth)
        return TreeSpec((-1,) + tuple(range(self.depth)) + (0,) * (self.total_tokens - self.depth))

    @property
    def tree_slots(self) -> int:
        """Head cache slots the expansion writes past the committed length."""
        return max((self.depth - 1) * self.top_k, self.tree.max_depth + 1)

    # ------------------------------------------------------------------------------------------ engine hooks
    def init(self, dparams, target_params, prompts, prompt_lens, capacity, features=None):
        """Fill the head's cache with the prompt's pairs (prompt token t+1 ; target feature t), t < P - 1."""
        if features is None:
            raise EagleDrafterError("the EAGLE drafter needs the target's features at prefill; the engine passes "
                                    "them when drafter.features is non-empty")
        hp, embed = dparams["head"], dparams["embed"]
        B, P = prompts.shape
        cache = init_head_cache(self.head, B, capacity + self.tree_slots, features.dtype)
        toks = jnp.concatenate([prompts[:, 1:], jnp.zeros((B, 1), prompts.dtype)], axis=1)
        pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((P, P), bool)), (B, P, P))
        zero = jnp.zeros((B,), jnp.int32)
        mask = dense_mask(zero, causal, cache.capacity)
        _, cache = head_hidden(hp, self.head, embed, toks, features, pos, mask, cache, zero)
        # Rows past a prompt's end hold padding pairs; they lie at slots >= the length and get overwritten.
        cache = cache._replace(lengths=(prompt_lens - 1).astype(jnp.int32))
        C = max(self.catch_up, 1)
        return EagleState(cache, jnp.zeros((B, C, features.shape[-1]), features.dtype), jnp.zeros((B,), jnp.int32),
                          jnp.zeros((B,), jnp.int32))

    def update(self, dparams, dstate, ctx, result):
        return dstate

    def observe_plain(self, dparams, dstate: EagleState, ctx: DraftContext):
        # The engine decodes plainly this step and hands over only the decoded token's feature next time, so the
        # pairs committed last step (ctx.target_hidden) must be kept now: appended (eager) or buffered.
        feats, count = ctx.target_hidden  # [B, D+1, F], [B]
        B, D1, _ = feats.shape
        if not (ctx.allow_cond and self.catch_up >= D1):
            return dstate._replace(cache=self._append(dparams, dstate.cache, ctx)[1])
        st = jax.lax.cond(jnp.any(dstate.pend_n + count > self.catch_up),
                          lambda s: self._flush(dparams, s, ctx), lambda s: s, dstate)
        # The new pairs sit at [L - count, L), right after the pending ones (consecutive plain steps commit
        # consecutive positions); a row with nothing pending starts its run there.
        start = jnp.where(st.pend_n == 0, ctx.lengths - count, st.pend_start)
        i = jnp.arange(D1, dtype=jnp.int32)[None, :]
        dst = jnp.where(i < count[:, None], st.pend_n[:, None] + i, self.catch_up)  # catch_up = dropped
        buf = st.pend_feats.at[jnp.arange(B)[:, None], dst].set(feats.astype(st.pend_feats.dtype), mode="drop")
        return EagleState(st.cache, buf, start.astype(jnp.int32), st.pend_n + count)

    def _flush(self, dparams, st: EagleState, ctx: DraftContext) -> EagleState:
        """Write the pending pairs into the head's cache with one head forward over the whole buffer. Slots past
        a row's pending pairs (and, for a row with none, slots from its committed length on) get padding pairs
        that no query sees before a later append rewrites them."""
        C = self.catch_up
        B = st.pend_n.shape[0]
        s0 = jnp.where(st.pend_n > 0, st.pend_start, ctx.lengths)
        i = jnp.arange(C, dtype=jnp.int32)[None, :]
        pos = s0[:, None] + i
        toks = jnp.take_along_axis(ctx.history, jnp.clip(pos + 1, 0, ctx.history.shape[1] - 1), axis=1)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (B, C, C))
        mask = dense_mask(s0, causal, st.cache.capacity)
        _, cache = head_hidden(dparams["head"], self.head, dparams["embed"], toks,
                               st.pend_feats.astype(st.cache.k[0].dtype), pos, mask, st.cache, s0)
        return st._replace(cache=cache, pend_n=jnp.zeros_like(st.pend_n))

    def flush_pending(self, dparams, st: EagleState, ctx: DraftContext) -> EagleState:
        """st with its pending pairs written into the head's cache (what `propose` does first)."""
        if not (ctx.allow_cond and self.catch_up >= ctx.target_hidden[0].shape[1]):
            return st
        return jax.lax.cond(jnp.any(st.pend_n > 0), lambda s: self._flush(dparams, s, ctx), lambda s: s, st)

    # ------------------------------------------------------------------------------------------ propose
    def _append(self, dparams, cache: KVCache, ctx: DraftContext):
        """Write the newly committed pairs; returns (hidden at the last pair [B, H], cache)."""
        feats, count = ctx.target_hidden  # [B, D+1, F], [B]
        B, D1, _ = feats.shape
        L = ctx.lengths
        start = L - count
        i = jnp.arange(D1, dtype=jnp.int32)[None, :]
        toks = jnp.take_along_axis(ctx.history, jnp.clip(start[:, None] + 1 + i, 0, ctx.history.shape[1] - 1), axis=1)
        pos = start[:, None] + i
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((D1, D1), bool)), (B, D1, D1))
        mask = dense_mask(start, causal, cache.capacity)
        hidden, cache = head_hidden(dparams["head"], self.head, dparams["embed"], toks, feats.astype(cache.k[0].dtype),
                                    pos, mask, cache, start)
        last = jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0]
        return last, cache

    def _top(self, dparams, hidden):
        """hidden [B, n, H] -> (log-probs [B, n, k], target token ids [B, n, k]) of the top_k per row."""
        logits = head_logits(dparams["head"], self.head, dparams, hidden)
        logp = jax.nn.log_softmax(logits, axis=-1)
        vals, idx = jax.lax.top_k(logp, self.top_k)
        return vals, to_target_ids(dparams["head"], self.head, idx).astype(jnp.int32)

    def propose(self, dparams, dstate: EagleState, ctx: DraftContext):
        st = self.flush_pending(dparams, dstate, ctx)
        tok, score, parent, cache = self.candidates(dparams, st.cache, ctx)
        B = tok.shape[0]
        tokens, parents, valid = _select(tok, score, parent, self.total_tokens, self.depth)
        tokens = jnp.concatenate([ctx.last_token[:, None], tokens], axis=1)
        parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents], axis=1)
        valid = jnp.concatenate([jnp.ones((B, 1), bool), valid], axis=1)
        return Proposal(tokens, parents, valid, None), st._replace(cache=cache)

    def candidates(self, dparams, cache: KVCache, ctx: DraftContext):
        """Every candidate of the expansion: (tokens [B, C] target ids, scores [B, C] cumulative log-probs,
        parents [B, C] candidate index or -1 for the root's children, head cache with lengths = L).
        C = top_k + (depth - 1) * top_k^2; level 1 is [0, top_k), level s + 1 is [top_k + (s-1) top_k^2, ...).
        cache: the head's cache with no pairs pending (`EagleState.cache` after a flush)."""
        k, depth = self.top_k, self.depth
        B = ctx.last_token.shape[0]
        L = ctx.lengths
        root_hidden, cache = self._append(dparams, cache, ctx)
        logp, toks = self._top(dparams, root_hidden[:, None])  # [B, 1, k]
        # Candidate arrays over all levels: level 1 = indices [0, k), level s + 1 = [k + (s-1) k^2, k + s k^2).
        cand_tok = [toks[:, 0]]
        cand_score = [logp[:, 0]]
        cand_parent = [jnp.full((B, k), -1, jnp.int32)]
        front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (B, k))  # candidate index of each frontier node
        front_tok, front_score = toks[:, 0], logp[:, 0]
        front_feat = jnp.broadcast_to(root_hidden[:, None], (B, k, root_hidden.shape[-1]))
        E = (depth - 1) * k  # tree slots written by the expansion, at [L, L + E)
        anc = jnp.zeros((B, k, max(E, 1)), bool)  # per frontier node: which tree slots are its expanded ancestors
        base = k
        for s in range(1, depth):
            slot = (s - 1) * k + jnp.arange(k)
            own = jax.nn.one_hot(slot, max(E, 1), dtype=bool)[None]  # [1, k, E]
            anc_now = anc | own
            mask = _prefix_and_tree_mask(L, anc_now, cache.capacity)
            pos = jnp.broadcast_to((L + s - 1)[:, None], (B, k))
            hidden, cache = head_hidden(dparams["head"], self.head, dparams["embed"], front_tok, front_feat, pos,
                                        mask, cache, L + (s - 1) * k, from_target=False)
            logp, toks = self._top(dparams, hidden)  # [B, k, k]
            scores = (front_score[:, :, None] + logp).reshape(B, k * k)
            cand_tok.append(toks.reshape(B, k * k))
            cand_score.append(scores)
            cand_parent.append(jnp.repeat(front, k, axis=1))
            # The next frontier: the best k of the k * k new candidates.
            best_score, best = jax.lax.top_k(scores, k)
            parent_row = best // k  # which frontier node each new frontier node descends from
            front = base + best
            front_tok = jnp.take_along_axis(toks.reshape(B, k * k), best, axis=1)
            front_score = best_score
            front_feat = jnp.take_along_axis(hidden, parent_row[:, :, None], axis=1)
            anc = jnp.take_along_axis(anc_now, parent_row[:, :, None], axis=1)
            base += k * k
        return (jnp.concatenate(cand_tok, axis=1), jnp.concatenate(cand_score, axis=1),
                jnp.concatenate(cand_parent, axis=1), cache._replace(lengths=L))


def _prefix_and_tree_mask(lengths, anc, capacity: int):
    """[B, k, S] bool: slot s visible to query j iff s < lengths[b], or s = lengths[b] + e with anc[b, j, e]."""
    E = anc.shape[-1]
    s = jnp.arange(capacity)
    rel = s[None, :] - lengths[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < E)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, E - 1)[:, None, :], anc.shape[:2] + (capacity,))
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & jnp.take_along_axis(anc, idx, axis=2))


def _select(tok, score, parent, n: int, depth: int):
    """The best n candidates as tree nodes 1..n. tok/score/parent [B, C] (parent = candidate index, -1 = root).

    Returns tokens [B, n] int32, parents [B, n] int32 (node indices, 0 = root) and valid [B, n] bool.
    """
    _, sel = jax.lax.top_k(score, n)  # descending; equal scores keep candidate order (parents come first)
    tokens = jnp.take_along_axis(tok, sel, axis=1)
    pcand = jnp.take_along_axis(parent, sel, axis=1)  # [B, n]
    match = sel[:, None, :] == pcand[:, :, None]  # [B, n (child), n (candidate position)]
    found = jnp.any(match, axis=-1)
    pnode = jnp.where(pcand < 0, 0, jnp.argmax(match, axis=-1) + 1).astype(jnp.int32)
    own = jnp.arange(1, n + 1, dtype=jnp.int32)[None]
    # A node whose parent was not selected (only possible through exact score ties at the cut) is dropped, and
    # so, transitively, is its subtree; every kept node's parent precedes it.
    valid = ((pcand < 0) | found) & (pnode < own)
    pnode = jnp.where(valid, pnode, 0)
    full = jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], axis=1)  # the root is always valid
    for _ in range(depth):
        full = full.at[:, 1:].set(full[:, 1:] & jnp.take_along_axis(full, pnode, axis=1))
    return tokens, pnode, full[:, 1:]


# ============================================================================================ building
DEFAULT_HEADS = {"eagle": "assets/smollm2-135m-eagle", "eagle3": "assets/smollm2-135m-eagle3"}


def resolve_head_path(model: str | None, method: str) -> str:
    """A head path as given, or relative to the installed package (the shipped `assets/...` heads); None picks
    the head shipped for SmolLM2-135M."""
    from specjax.heads.eagle_io import HeadFormatError

    model = model or DEFAULT_HEADS[method]
    found, packaged = find_packaged(model)
    if found is None:
        raise HeadFormatError(f"head path {model!r} does not exist (also looked in {packaged})")
    return found


def load_eagle_drafter(path: str, method: str, target_config, target_params: dict, *, top_k: int = 8,
                       depth: int = 5, total_tokens: int = 32):
    """(EagleDrafter, dparams) for the head at `path` on this target. method: 'eagle' or 'eagle3' (the head's
    kind must match); top_k == 1 gives the top-1 chain of `depth` tokens. Head weights are cast to the target
    embedding's dtype; the target's embedding (and untied or quantized LM head) are shared, not copied."""
    from specjax.heads.eagle_io import load_head

    hcfg, params = load_head(path, target_config)
    if not isinstance(hcfg, HeadConfig) or hcfg.kind != method:
        got = hcfg.kind if isinstance(hcfg, HeadConfig) else type(hcfg).__name__
        raise EagleDrafterError(f"method {method!r} but the head at {path} is of kind {got!r}; use method {got!r}")
    dtype = target_params["embed"].dtype
    head = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.int32 if a.dtype.kind in "iu" else dtype), params)
    dparams = {"head": head, "embed": target_params["embed"]}
    if method == "eagle":
        # EAGLE-1 maps its predicted feature through the target's own LM head: quantized when the target's is.
        for key in ("lm_head", "lm_head_q"):
            if key in target_params:
                dparams[key] = target_params[key]
    if top_k == 1:
        return EagleDrafter.chain_of(hcfg, depth), dparams
    return EagleDrafter(hcfg, top_k, depth, total_tokens), dparams
