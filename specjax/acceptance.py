"""Lossless acceptance of drafted chains and token trees: one static-shape scan, shared by every drafter.

One verify step emits the accepted path plus one more token: a correction sample at the node where the walk
stopped on a rejection, or a bonus sample from the target at the deepest accepted node. Losslessness is with
respect to `p`, the target's PROCESSED next-token distribution (temperature, top-k, top-p already applied, the
same processing plain decoding uses). In the sampling modes `q` must be exactly the distribution each draft
token was sampled from, after the drafter's own processing: a `q` that differs from what was sampled (raw
logits while the drafter sampled with top-p, another temperature, another precision) breaks losslessness.

Modes (a chain is a one-branch tree, so it needs no mode of its own):

* ``"deterministic"``: the candidate set is a function of the context (top-k trees of EAGLE-2 / Medusa,
  n-gram and suffix lookups). Walk the children of the current node in drafted order and accept child x with
  probability P(x); on rejection zero x in P and renormalise. `q` is ignored and may be None.
* ``"iid"``: siblings are independent draws from q[parent] (SpecInfer multi-step speculative sampling).
  Accept x if u * Q(x) < P(x); on rejection P <- norm(max(P - Q, 0)). Duplicate draws must stay separate
  sibling nodes (one test and one residual update per draw); merging them into one node is not lossless here.
* ``"wor"``: siblings are drawn without replacement, q[parent] being the distribution of the FIRST draw
  (recursive rejection sampling, Sequoia). As iid, but after each rejection x is removed from Q and Q is
  renormalised, and the residual uses the Q the rejected child was tested against.

Greedy decoding is not a mode: pass ``p = one_hot(argmax)`` (and, for a greedy drafter, ``q = one_hot``). Then
in every mode a child is accepted iff its token is the argmax (u < 1 always passes, P(x) = 0 never does), every
residual of a one-hot P is that same one-hot (or falls back to it), and the final sample is the argmax.

Everything is selects, one-hot products and `lax.scan`: no host sync, no `lax.cond`, no data-dependent loop,
no sort, no scatter, so it jits, vmaps and runs on any backend. Uniforms come in as arguments, so the caller
owns the RNG. Arithmetic is float32 whatever the input dtype.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError

__all__ = [
    "MODES",
    "AcceptanceError",
    "AcceptResult",
    "accept_tree",
    "accepted_path",
    "residual",
    "remove_token",
    "sample_from",
    "tree_depth",
    "typical_accept",
    "TypicalMode",
    "greedy_accept_tree",
    "accept",
]

MODES = ("deterministic", "iid", "wor")

_F32 = jnp.float32
# Smallest normal float32: a residual with less total mass than this is treated as empty (rounding noise).
_TINY = float(jnp.finfo(jnp.float32).tiny)


class AcceptanceError(SpecjaxError, ValueError):
    """Bad arguments to an acceptance function (wrong mode, shape or missing q)."""


class AcceptResult(NamedTuple):
    """Outcome of one verify step for a batch.

    accepted:     [B, N] bool  node lies on the accepted path (the root, node 0, is never marked)
    num_accepted: [B] int32    number of accepted draft tokens (= depth of `last_node`)
    last_node:    [B] int32    deepest accepted node, 0 (the root) if none was accepted
    next_token:   [B] int32    correction sample at the stopping node, or bonus sample from p[last_node]
    """

    accepted: jax.Array
    num_accepted: jax.Array
    last_node: jax.Array
    next_token: jax.Array


# --------------------------------------------------------------------------------------------------------------
# Small building blocks. `residual` and `remove_token` are looked up by name at trace time, so a test can
# monkeypatch them to plant a bug and check that the statistical tests notice.
# --------------------------------------------------------------------------------------------------------------


def _normalise_or(r: jax.Array, fallback: jax.Array) -> jax.Array:
    """r / sum(r) over the last axis, or `fallback` where r has no mass (never divides by zero)."""
    s = jnp.sum(r, axis=-1, keepdims=True)
    ok = s > _TINY
    # XLA backends do not always round r / s correctly (x / x can give 1 - 2**-24), and greedy decoding relies
    # on a one-hot P staying exactly one-hot: an entry holding all the mass is set to exactly 1.
    out = jnp.where(r == s, 1.0, r / jnp.where(ok, s, 1.0))
    return jnp.where(ok, out, fallback)


def residual(P: jax.Array, Q: jax.Array) -> jax.Array:
    """Residual after a rejection: norm(max(P - Q, 0)) over the last axis.  P, Q: [..., V] -> [..., V].

    When the residual has no mass (P <= Q everywhere, which for normalised P and Q means P == Q and a rejection
    could only come from rounding) it returns P itself instead of NaN.
    """
    return _normalise_or(jnp.maximum(P - Q, 0.0), P)


def remove_token(Q: jax.Array, x_onehot: jax.Array) -> jax.Array:
    """Draft distribution of the next draw without replacement: norm(Q with token x zeroed).  [..., V].

    When x held all of Q's mass (no further draw is possible) it returns Q unchanged instead of NaN.
    """
    return _normalise_or(Q * (1.0 - x_onehot), Q)


def sample_from(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sample from (possibly unnormalised, non-negative) probabilities.

    probs: [..., V], u: [...] uniforms in [0, 1) -> [...] int32.
    Picks the first token t with probs[t] > 0 and cumsum[t] > u * total. Requiring probs[t] > 0 explicitly
    means a zero-probability token is never returned, whatever the rounding of the cumulative sum; when
    rounding leaves u * total at or above every cumulative value, the last nonzero token is returned.
    An all-zero row returns 0.
    """
    r = jnp.maximum(jnp.asarray(probs, _F32), 0.0)
    c = jnp.cumsum(r, axis=-1)
    target = jnp.asarray(u, _F32)[..., None] * c[..., -1:]
    hit = (r > 0) & (c > target)
    first = jnp.argmax(hit, axis=-1)
    V = r.shape[-1]
    last_nonzero = jnp.max(jnp.where(r > 0, jnp.arange(V), 0), axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), first, last_nonzero).astype(jnp.int32)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b at full float32 precision (TPUs default to bf16 passes, which would round the probabilities)."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _pick(onehot: jax.Array, x: jax.Array) -> jax.Array:
    """sum(onehot * x) over the last axis: an index lookup written as a one-hot product (no gather)."""
    return jnp.sum(onehot * x, axis=-1)


# --------------------------------------------------------------------------------------------------------------
# Argument checks (static shapes only: they run at trace time and never sync with the device).
# --------------------------------------------------------------------------------------------------------------


def _check_tree_args(tokens, parents, valid, p, u_final) -> tuple[int, int, int]:
    """Check the shapes shared by accept_tree and typical_accept; return (B, N, V)."""
    if p is None or jnp.ndim(p) != 3:
        raise AcceptanceError(f"p must be [B, N, V] probabilities, got shape {jnp.shape(p)}; add a batch axis")
    B, N, V = jnp.shape(p)
    if N < 1:
        raise AcceptanceError("the tree needs at least the root node (N >= 1)")
    for name, a in (("tokens", tokens), ("parents", parents), ("valid", valid)):
        if jnp.shape(a) != (B, N):
            raise AcceptanceError(f"{name} must have shape [B, N] = {(B, N)} to match p, got {jnp.shape(a)}")
    if jnp.shape(u_final) != (B,):
        raise AcceptanceError(f"u_final must have shape [B] = {(B,)}, got {jnp.shape(u_final)}")
    return B, N, V


# --------------------------------------------------------------------------------------------------------------
# Lossless tree walk.
# --------------------------------------------------------------------------------------------------------------


def _walk_one(tokens, parents, valid, p, q, u_accept, *, mode: str):
    """One request: tokens/parents/valid/u_accept [N], p [N, V], q [N, V] (or [N] dummy when deterministic).

    Returns (accepted [N] bool, last_node [] int32, P [V] f32: the distribution of the final sample).
    Scans all N nodes in topological order; the root is excluded by `j > 0`, so parents[0] need not be -1.
    """
    N, V = p.shape
    use_q = mode != "deterministic"

    def step(carry, xs):
        cur, P, Q = carry
        j, tok, par, ok, u, p_j, q_j = xs
        x = jax.nn.one_hot(tok, V, dtype=_F32)                  # [V]; out-of-range token -> zeros, never accepted
        is_child = ok & (par == cur) & (j > 0)
        px = _pick(x, P)
        if use_q:
            # u * Q(x) < P(x) accepts with probability min(1, P(x) / Q(x)) without dividing.
            acc = is_child & (u * _pick(x, Q) < px)
            P_rej = residual(P, Q)
        else:
            # Q = one-hot(x) scaled by P(x): the residual is P with x zeroed, exactly.
            acc = is_child & (u < px)
            P_rej = residual(P, P * x)
        rej = is_child & ~acc
        # Accepting descends: the children of j are tested against the target and draft after node j.
        P_new = jnp.where(acc, p_j, jnp.where(rej, P_rej, P))
        if use_q:
            Q_rej = remove_token(Q, x) if mode == "wor" else Q
            Q_new = jnp.where(acc, q_j, jnp.where(rej, Q_rej, Q))
        else:
            Q_new = Q
        cur_new = jnp.where(acc, j, cur)
        return (cur_new, P_new, Q_new), acc

    Q0 = q[0] if use_q else jnp.zeros((), _F32)
    init = (jnp.int32(0), p[0], Q0)
    xs = (jnp.arange(N, dtype=jnp.int32), tokens, parents, valid, u_accept, p, q)
    (last, P, _), accepted = jax.lax.scan(step, init, xs)
    return accepted, last, P


def accept_tree(tokens, parents, valid, p, q, u_accept, u_final, *, mode: str) -> AcceptResult:
    """Lossless acceptance of a drafted token tree (or chain) for a batch of requests.

    tokens   [B, N] int32  node tokens in topological order; node 0 is the root (last committed token, never tested)
    parents  [B, N] int32  parent index of each node (parents[:, 0] = -1), parent < child, siblings in drafted order
    valid    [B, N] bool   False for padding nodes: they are never accepted and never change P or Q (their
                           p, q rows and tokens may hold anything finite)
    p        [B, N, V] f32 target's processed next-token distribution after node i (rows sum to 1)
    q        [B, N, V] f32 distribution the drafter sampled the children of node i from (for "wor": the first
                           child's); ignored in "deterministic" mode, where it may be None
    u_accept [B, N] f32    uniforms in [0, 1) for the test of node j (u_accept[:, 0] is unused)
    u_final  [B] f32       uniform in [0, 1) for the final (correction or bonus) sample
    mode     one of MODES: "deterministic" | "iid" | "wor" (see the module docstring)

    Greedy: pass p = one_hot(argmax) (and q = one_hot for a greedy drafter); the result is then the path of
    children matching the argmax and next_token is the argmax at the stopping node, in every mode.
    Returns an AcceptResult; jit/vmap friendly (mode is static).
    """
    if mode not in MODES:
        raise AcceptanceError(f"mode={mode!r} is not one of {MODES}; pick the one that matches how the drafter "
                              "chose its tokens (deterministic for top-k / n-gram candidates)")
    B, N, V = _check_tree_args(tokens, parents, valid, p, u_final)
    if jnp.shape(u_accept) != (B, N):
        raise AcceptanceError(f"u_accept must have shape [B, N] = {(B, N)}, got {jnp.shape(u_accept)}")
    if mode == "deterministic":
        q = jnp.zeros((B, N), _F32)                            # placeholder scanned alongside, never read
    elif q is None:
        raise AcceptanceError(f"mode={mode!r} needs q, the distribution the drafter sampled from; pass it, or use "
                              "mode='deterministic' if the candidates were not sampled")
    elif jnp.shape(q) != (B, N, V):
        raise AcceptanceError(f"q must have the shape of p {(B, N, V)}, got {jnp.shape(q)}")
    else:
        q = jnp.asarray(q, _F32)

    walk = jax.vmap(lambda t, pa, va, pp, qq, ua: _walk_one(t, pa, va, pp, qq, ua, mode=mode))
    accepted, last, P = walk(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                             jnp.asarray(valid, bool), jnp.asarray(p, _F32), q, jnp.asarray(u_accept, _F32))
    next_token = sample_from(P, jnp.asarray(u_final, _F32))
    num = jnp.sum(accepted, axis=-1, dtype=jnp.int32)
    return AcceptResult(accepted, num, last.astype(jnp.int32), next_token)


def greedy_accept_tree(tokens, parents, valid, argmax_p) -> AcceptResult:
    """`accept_tree` for a batch where every request is greedy, from the target's argmax alone.

    tokens/parents/valid [B, N] as in `accept_tree`; argmax_p [B, N] int32: the argmax of the target's logits after
    each node. With p = one_hot(argmax_p) the general walk accepts a child iff its token is the argmax at the
    current node (u < 1 = P(x), and u * Q(x) < 1), a rejection leaves P one-hot at the same argmax (the residual
    of a one-hot P is itself, or falls back to it), and the final sample is that argmax: the same result in every
    mode and for any q and uniforms, computed on [B] scalars instead of N passes over [B, V] rows.
    """
    tokens, parents = jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32)
    valid, argmax_p = jnp.asarray(valid, bool), jnp.asarray(argmax_p, jnp.int32)
    B, N = tokens.shape
    # argmax_p[b, node[b]] as a one-hot select (no gather, like the rest of this module)
    at = lambda node: jnp.sum(jnp.where(jnp.arange(N)[None, :] == node[:, None], argmax_p, 0), axis=1)

    def step(cur, xs):
        j, tok, par, ok = xs  # [] and [B] x3
        want = at(cur)
        acc = ok & (par == cur) & (j > 0) & (tok == want)
        return jnp.where(acc, j, cur), acc

    xs = (jnp.arange(N, dtype=jnp.int32), tokens.T, parents.T, valid.T)
    last, accepted = jax.lax.scan(step, jnp.zeros((B,), jnp.int32), xs)
    accepted = accepted.T
    next_token = at(last)
    return AcceptResult(accepted, jnp.sum(accepted, axis=-1, dtype=jnp.int32), last, next_token)


# --------------------------------------------------------------------------------------------------------------
# Tree helpers.
# --------------------------------------------------------------------------------------------------------------


def tree_depth(parents: jax.Array) -> jax.Array:
    """Depth of every node (root 0) from parent indices.  parents [N] or [B, N] int32 -> same shape int32.

    Needs parent < child (topological order); computed with a scan and one-hot lookups.
    """
    parents = jnp.asarray(parents, jnp.int32)
    if parents.ndim not in (1, 2):
        raise AcceptanceError(f"parents must be [N] or [B, N], got shape {parents.shape}")
    N = parents.shape[-1]

    def one(par):
        def step(depth, xs):
            j, par_j = xs
            d = jnp.where(j > 0, _pick(jax.nn.one_hot(par_j, N, dtype=jnp.int32), depth) + 1, 0)
            return jnp.where(jnp.arange(N) == j, d, depth), None

        depth, _ = jax.lax.scan(step, jnp.zeros((N,), jnp.int32), (jnp.arange(N), par))
        return depth

    return one(parents) if parents.ndim == 1 else jax.vmap(one)(parents)


def accepted_path(accepted: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """Node indices of the accepted path in depth order.

    accepted [B, N] bool, depth [B, N] or [N] int (root depth 0) -> [B, max_depth] int32 whose column d-1 is
    the accepted node at depth d, padded with 0 beyond num_accepted. A path has at most one node per depth, so
    this is a masked sum over nodes (one-hot formulation, no scatter).
    """
    accepted = jnp.asarray(accepted, bool)
    if accepted.ndim != 2:
        raise AcceptanceError(f"accepted must be [B, N], got shape {accepted.shape}")
    B, N = accepted.shape
    if jnp.shape(depth) not in ((N,), (B, N)):
        raise AcceptanceError(f"depth must be [N] or [B, N] = {(B, N)}, got {jnp.shape(depth)}")
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (B, N))
    levels = jnp.arange(1, max_depth + 1, dtype=jnp.int32)
    hit = accepted[:, None, :] & (depth[:, None, :] == levels[None, :, None])    # [B, max_depth, N]
    return jnp.sum(jnp.where(hit, jnp.arange(N, dtype=jnp.int32), 0), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------------------
# Medusa typical acceptance (LOSSY, opt-in only).
# --------------------------------------------------------------------------------------------------------------


def typical_accept(tokens, parents, valid, p, *, posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3, u_final) -> AcceptResult:
    """Medusa typical acceptance. LOSSY: the output distribution is NOT the target's; use only as an opt-in.

    A child x of node i passes if p[i](x) > min(posterior_threshold, posterior_alpha * exp(-H(p[i]))), with
    H(p) = -sum p log(p + 1e-5). A node is accepted when it and all its ancestors pass; the chosen path ends at
    the deepest accepted node, ties broken by the larger sum of log p along the path (then the lower index).
    next_token is sampled from p[last_node] with u_final.

    tokens [B, N] int32, parents [B, N] int32, valid [B, N] bool, p [B, N, V] f32 (processed target; padding
    rows must be finite too, they enter one-hot products), u_final [B].
    Returns an AcceptResult (same fields as accept_tree).
    """
    B, N, V = _check_tree_args(tokens, parents, valid, p, u_final)

    def one(tok, par, val, pp):
        pp = jnp.asarray(pp, _F32)
        H = -jnp.sum(pp * jnp.log(pp + 1e-5), axis=-1)                              # [N]
        thr = jnp.minimum(posterior_threshold, posterior_alpha * jnp.exp(-H))       # [N]
        par_oh = jax.nn.one_hot(par, N, dtype=_F32)                                 # [N, N]; root row zeros
        p_parent = _mm(par_oh, pp)                                                  # [N, V] p of each parent
        px = _pick(jax.nn.one_hot(tok, V, dtype=_F32), p_parent)                    # [N] p_parent(token)
        passes = val & (px > _mm(par_oh, thr)) & (jnp.arange(N) > 0)
        logp = jnp.log(jnp.where(passes, px, 1.0))

        def down(carry, xs):
            # Walk nodes in topological order: a node is accepted if it passes and its parent was accepted;
            # depth and sum of log p accumulate along the path.
            ok, depth, score = carry
            j, par_j, passes_j, logp_j = xs
            oh = jax.nn.one_hot(par_j, N, dtype=_F32)
            ok_j = passes_j & (_pick(oh, ok.astype(_F32)) > 0)
            d_j = _pick(oh, depth.astype(_F32)).astype(jnp.int32) + 1
            s_j = _pick(oh, score) + logp_j
            at = (jnp.arange(N) == j) & (j > 0)
            return (jnp.where(at, ok_j, ok), jnp.where(at, d_j, depth), jnp.where(at, s_j, score)), None

        idx = jnp.arange(N, dtype=jnp.int32)
        init = (idx == 0, jnp.zeros((N,), jnp.int32), jnp.zeros((N,), _F32))
        (ok, depth, score), _ = jax.lax.scan(down, init, (idx, par, passes, logp))
        best_depth = jnp.max(jnp.where(ok, depth, 0))
        best = jnp.argmax(jnp.where(ok & (depth == best_depth), score, -jnp.inf)).astype(jnp.int32)

        def up(target, xs):
            # Reverse topological order meets each ancestor of `best` after its child: mark it, move up.
            j, par_j = xs
            on = (j == target) & (j > 0)
            return jnp.where(on, par_j, target), on

        _, on_rev = jax.lax.scan(up, best, (idx[::-1], par[::-1]))
        accepted = on_rev[::-1]
        p_last = _mm(jax.nn.one_hot(best, N, dtype=_F32), pp)                       # [V] p of last node
        return accepted, best, p_last

    accepted, last, p_last = jax.vmap(one)(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                                           jnp.asarray(valid, bool), p)
    next_token = sample_from(p_last, jnp.asarray(u_final, _F32))
    return AcceptResult(accepted, jnp.sum(accepted, axis=-1, dtype=jnp.int32), last, next_token)


@dataclasses.dataclass(frozen=True)
class TypicalMode:
    """Medusa typical acceptance as a drafter `mode` (LOSSY: outputs no longer follow the target's distribution).

    A drafted child x of node i passes if p_i(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_i))); the
    longest passing path is taken (`typical_accept`). Under greedy decoding it accepts exactly the argmax, like
    the lossless rule. Hashable, so it rides in the static drafter like the string modes.
    """

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    lossy: bool = dataclasses.field(default=True, init=False)


def accept(tokens, parents, valid, p, q, u_accept, u_final, mode) -> AcceptResult:
    """The rule a drafter's `mode` names: `accept_tree` for "deterministic" / "iid" / "wor" (lossless),
    `typical_accept` for a `TypicalMode` (lossy, opt-in). Same arguments as `accept_tree`."""
    if isinstance(mode, TypicalMode):
        return typical_accept(tokens, parents, valid, p, posterior_threshold=mode.posterior_threshold,
                              posterior_alpha=mode.posterior_alpha, u_final=u_final)
    return accept_tree(tokens, parents, valid, p, q, u_accept, u_final, mode=mode)
