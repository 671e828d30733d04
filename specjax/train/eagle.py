"""Train EAGLE heads (EAGLE-1/2 and EAGLE-3) on self-distillation data, in JAX.

Data: the `.npz` of `specjax.train.data` (the target's own answers to the project's prompts, with its top-k
log-probabilities at every response step). The target's features for every position come from ONE prefill-style
forward per batch of sequences (`specjax.train.features`), computed once and kept in a cache file (float16) that
both head kinds share: the final hidden state (EAGLE-1/2) and three layer outputs
(EAGLE-3).

Loss, at every unroll step j (the head run on its own outputs, see `specjax.heads.eagle.unrolled_hidden`; step
j's weight is step_decay^j), on response positions only:
  eagle   reg_weight * smooth-L1(predicted feature, target feature) + ce_weight * soft cross-entropy against
          the target's top-k distribution; the head's log-softmax is taken over a `loss_vocab` subset of the
          vocabulary (the most frequent target tokens) to keep the 49k-wide LM head affordable on CPU.
  eagle3  soft cross-entropy against the target's top-k distribution restricted to the draft vocabulary
          ("training-time test": unroll >= 3).
Metrics: per unroll step top-1 agreement with the target's greedy token; on the held-out split also the chain
acceptance alpha_j = P(step j right | steps < j right), which on greedy text is exactly what a top-1 chain
would get accepted (full vocabulary for EAGLE-1/2).

Run: `python -m specjax.train.eagle --kind eagle|eagle3 --data FILE --out DIR` (see --help). The loop is
`specjax.train.loop.fit`: orbax checkpoints every N steps; rerunning the same command resumes. The head is
exported (bf16, in the EAGLE or EAGLE-3 release format, see `specjax.heads.eagle_io`) to OUT/head with training
curves as PNG.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.heads.eagle import HeadConfig, default_eagle3_layers, head_config, head_logits, init_from_target, \
    unrolled_hidden
from specjax.train.common import TrainError, always_ids, cached_array, check_run, select_vocab
from specjax.train.corpus import add_corpus_blocks_arg
from specjax.train.features import load_or_compute_features
from specjax.train.loop import add_loop_options, apply_gradients, fit, last_eval, make_optimizer, pyplot_or_none, \
    report, save_figure, smoothed, split_history, train_mean


class HeadTrainError(TrainError):
    """A head training run cannot start or continue as asked; the message says how to fix it."""


# ============================================================================================ data
def truncate(arrays: dict, max_len: int) -> dict:
    """Sequences cut to their first `max_len` tokens (the response steps past the cut are dropped)."""
    out = dict(arrays)
    out["tokens"] = arrays["tokens"][:, :max_len]
    out["length"] = np.minimum(arrays["length"], max_len).astype(arrays["length"].dtype)
    keep = arrays["prompt_len"] < out["length"]  # a prompt that fills the window leaves nothing to learn
    if not keep.all():
        out = {k: (v[keep] if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == keep.size else v)
               for k, v in out.items()}
    return out


# ============================================================================================ targets
def position_targets(arrays: dict, vocab_size: int, out_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-position soft targets: entry p is the target's distribution of token p + 1 (response positions only).

    out_ids: the head's output vocabulary as target ids [Vo] (None = the full vocabulary). Returns
    soft_idx [N, L, K] int32 (head-vocabulary index of each top-k entry, 0 where absent), soft_p [N, L, K]
    float32 (renormalised over the entries inside the head vocabulary), greedy [N, L] int32 (head index of the
    target's greedy token, -1 outside the head vocabulary), mask [N, L] bool (a target exists).
    """
    N, L = arrays["tokens"].shape
    ids, logp = arrays["topk_ids"], arrays["topk_logp"].astype(np.float32)
    R, K = ids.shape[1:]
    plen = arrays["prompt_len"].astype(np.int64)
    nresp = (arrays["length"] - arrays["prompt_len"]).astype(np.int64)
    p = np.arange(L)[None, :]
    step = p - (plen[:, None] - 1)  # response step predicted at position p
    mask = (step >= 0) & (step < nresp[:, None])
    st = np.clip(step, 0, R - 1)
    rows = np.arange(N)[:, None]
    tid = ids[rows, st]  # [N, L, K]
    prob = np.exp(logp[rows, st]) * mask[..., None]
    if out_ids is None:
        idx = tid
    else:
        t2o = np.full(vocab_size, -1, np.int64)
        t2o[out_ids] = np.arange(out_ids.size)
        idx = t2o[tid]
        prob = prob * (idx >= 0)
    prob = prob / np.maximum(prob.sum(-1, keepdims=True), 1e-30)
    greedy = np.where(mask, idx[..., 0], -1)
    return {"soft_idx": np.maximum(idx, 0).astype(np.int32), "soft_p": prob.astype(np.float32),
            "greedy": greedy.astype(np.int32), "mask": mask}


# ============================================================================================ loss
def _shift(a: jax.Array, by: int, fill=0) -> jax.Array:
    """a[:, t + by] at row t along axis 1, `fill` past the end."""
    pad = jnp.full((a.shape[0], by) + a.shape[2:], fill, a.dtype)
    return jnp.concatenate([a[:, by:], pad], axis=1)


LOSSES = ("kl", "tv", "hybrid")


def step_losses(train: dict, frozen: dict, cfg: HeadConfig, batch: dict, unroll: int, ce_weight: float,
                reg_weight: float, loss_kind: str = "kl"):
    """Per unroll step (loss [U], ce [U], tv [U], reg [U], top1 [U], count [U]) summed over the batch's positions.

    loss_kind: the distribution-matching term. "kl": soft cross-entropy against the target's top-k (its KL up to
    a constant); "tv": total variation 1 - sum_k min(p_k, q_k), which is 1 - the acceptance probability of a
    one-token draft (Leviathan et al.), so it optimises acceptance itself; "hybrid": their sum (KL keeps the
    gradient alive where TV is flat, far from the target).

    batch: tokens [B, T], feats [B, T, F], soft_idx/soft_p [B, T, K], greedy [B, T], mask [B, T], and for eagle
    final [B, T, H] (the regression targets). frozen: embed [V, H] and the LM head the logits use (eagle: the
    target's, restricted to the loss vocabulary as "lm_head" [H, Vo]; eagle3: unused).
    """
    hs = unrolled_hidden(train, cfg, frozen["embed"], batch["tokens"], batch["feats"].astype(jnp.float32), unroll)
    out = {k: [] for k in ("loss", "ce", "tv", "reg", "top1", "count")}
    for j in range(unroll):
        h = hs[j]
        m = _shift(batch["mask"], 1 + j, False)
        mf = m.astype(jnp.float32)
        logits = head_logits(train, cfg, frozen, h)
        logq = jax.nn.log_softmax(logits, axis=-1)
        sidx = _shift(batch["soft_idx"], 1 + j)
        sp = _shift(batch["soft_p"], 1 + j)
        logq_k = jnp.take_along_axis(logq, sidx, axis=-1)
        ce = -jnp.sum(sp * logq_k, axis=-1)
        tv = 1.0 - jnp.sum(jnp.minimum(sp, jnp.exp(logq_k)), axis=-1)
        term = {"kl": ce, "tv": tv, "hybrid": ce + tv}[loss_kind]
        g = _shift(batch["greedy"], 1 + j, -1)
        top1 = (jnp.argmax(logits, axis=-1) == g) & m
        loss = term
        reg = jnp.zeros_like(ce)
        if cfg.kind == "eagle":
            d = h - _shift(batch["final"], 1 + j).astype(jnp.float32)
            ad = jnp.abs(d)
            reg = jnp.mean(jnp.where(ad < 1.0, 0.5 * d * d, ad - 0.5), axis=-1)
            loss = reg_weight * reg + ce_weight * term
        out["loss"].append(jnp.sum(loss * mf))
        out["ce"].append(jnp.sum(ce * mf))
        out["tv"].append(jnp.sum(tv * mf))
        out["reg"].append(jnp.sum(reg * mf))
        out["top1"].append(jnp.sum(top1))
        out["count"].append(jnp.sum(mf))
    return {k: jnp.stack(v) for k, v in out.items()}


def total_loss(train, frozen, cfg, batch, unroll, ce_weight, reg_weight, step_decay, loss_kind="kl"):
    s = step_losses(train, frozen, cfg, batch, unroll, ce_weight, reg_weight, loss_kind)
    w = jnp.asarray([step_decay ** j for j in range(unroll)], jnp.float32)
    per_step = s["loss"] / jnp.maximum(s["count"], 1.0)
    return jnp.sum(w * per_step) / jnp.sum(w), s


def update(train, opt_state, frozen, batch, *, cfg: HeadConfig, optimizer, unroll: int, ce_weight: float,
           reg_weight: float, step_decay: float, loss_kind: str = "kl"):
    """One AdamW step (pure): (train params, optimizer state, per-unroll-step sums of `step_losses`)."""
    return apply_gradients(total_loss, optimizer, train, opt_state, frozen, cfg, batch, unroll, ce_weight, reg_weight,
                           step_decay, loss_kind)


# The same step jitted on its own (params and optimizer state donated), for callers outside `fit`.
train_step = jax.jit(update, static_argnames=("cfg", "optimizer", "unroll", "ce_weight", "reg_weight", "step_decay",
                                             "loss_kind"),
                     donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("cfg", "unroll"))
def eval_matches(train, frozen, cfg: HeadConfig, batch, unroll: int):
    """(match [U, B, T] bool: step j at row t agrees with the target's greedy token, valid [U, B, T], ce [U],
    accept [U, B, T]: sum_k min(p_k, q_k) over the target's top-k, the probability that a draft sampled from the
    head at temperature 1 is accepted (a lower bound: the mass outside the top-k is left out))."""
    hs = unrolled_hidden(train, cfg, frozen["embed"], batch["tokens"], batch["feats"].astype(jnp.float32), unroll)
    matches, valids, ces, accepts = [], [], [], []
    for j in range(unroll):
        logits = head_logits(train, cfg, frozen, hs[j])
        m = _shift(batch["mask"], 1 + j, False)
        g = _shift(batch["greedy"], 1 + j, -1)
        logq = jax.nn.log_softmax(logits, axis=-1)
        sp = _shift(batch["soft_p"], 1 + j)
        logq_k = jnp.take_along_axis(logq, _shift(batch["soft_idx"], 1 + j), axis=-1)
        ce = -jnp.sum(sp * logq_k, axis=-1)
        matches.append((jnp.argmax(logits, axis=-1) == g) & m)
        valids.append(m)
        ces.append(jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1))
        accepts.append(jnp.where(m, jnp.sum(jnp.minimum(sp, jnp.exp(logq_k)), axis=-1), 0.0))
    return jnp.stack(matches), jnp.stack(valids), jnp.stack(ces), jnp.stack(accepts)


def sampled_acceptance(accept: np.ndarray, valid: np.ndarray) -> dict:
    """accept/valid [U, N, T] (from `eval_matches`) -> the per-step acceptance of a draft sampled at temperature 1
    ("accept_t1", teacher-forced: each step's context is the target's own text) and the tokens per verify step a
    chain of U such drafts would give if the steps were independent ("tau_chain_t1")."""
    U = accept.shape[0]
    per_step = [float(accept[j][valid[j]].mean()) if valid[j].any() else float("nan") for j in range(U)]
    tau, run = 1.0, 1.0
    for a in per_step:
        run *= 0.0 if np.isnan(a) else a
        tau += run
    return {"accept_t1": per_step, "tau_chain_t1": tau}


def chain_stats(match: np.ndarray, valid: np.ndarray) -> dict:
    """match/valid [U, N, T] -> per-step top-1, conditional chain acceptance alpha_j and the expected tokens
    per step tau of a top-1 chain of U drafts (over the rows where all U targets exist)."""
    U = match.shape[0]
    top1 = [float(match[j].sum() / max(valid[j].sum(), 1)) for j in range(U)]
    run = np.ones(match.shape[1:], bool)
    alpha, runs = [], []
    full = valid.all(axis=0)
    for j in range(U):
        now = run & match[j]
        den = (run & full).sum()
        alpha.append(float((now & full).sum() / den) if den else float("nan"))
        runs.append(now)
        run = now
    tau = 1.0 + sum(float((r & full).sum()) for r in runs) / max(int(full.sum()), 1)
    return {"top1": top1, "alpha": alpha, "tau_chain": tau}


# ============================================================================================ batches
def make_batches(length: np.ndarray, batch: int, bucket: int, seed: int, epoch: int, width: int):
    """One epoch of (row indices [batch], padded length): rows grouped by length rounded up to `bucket`, a pure
    function of (seed, epoch) so a resumed run sees the same batches."""
    rng = np.random.default_rng([seed, epoch])
    padded = np.minimum(-(-length // bucket) * bucket, width)
    out = []
    for size in np.unique(padded):
        members = rng.permutation(np.flatnonzero(padded == size))
        for s in range(0, members.size, batch):
            out.append((members[np.arange(s, s + batch) % members.size], int(size)))
    return [out[i] for i in rng.permutation(len(out))]


def host_batch(arrays: dict, feats: dict, targets: dict, rows: np.ndarray, size: int, kind: str) -> dict:
    b = {"tokens": arrays["tokens"][rows, :size].astype(np.int32),
         "feats": (feats["final"] if kind == "eagle" else feats["layers"])[rows, :size],
         "soft_idx": targets["soft_idx"][rows, :size], "soft_p": targets["soft_p"][rows, :size],
         "greedy": targets["greedy"][rows, :size], "mask": targets["mask"][rows, :size]}
    if kind == "eagle":
        b["final"] = feats["final"][rows, :size]
    return {k: jnp.asarray(v) for k, v in b.items()}


def evaluate(train, frozen_eval, cfg, arrays, feats, targets, rows, unroll, batch, bucket) -> dict:
    """Held-out per-step top-1, chain acceptance and cross-entropy (in the frozen_eval head vocabulary)."""
    N, L = arrays["tokens"].shape
    match = np.zeros((unroll, rows.size, L), bool)
    valid = np.zeros((unroll, rows.size, L), bool)
    ces, weights = [], []
    order = {r: i for i, r in enumerate(rows)}
    for idx, size in make_batches(arrays["length"][rows], batch, bucket, 0, 0, L):
        sel = rows[idx]
        m, v, ce, _ = jax.device_get(eval_matches(train, frozen_eval, cfg,
                                               host_batch(arrays, feats, targets, sel, size, cfg.kind), unroll))
        for k, r in enumerate(sel):
            match[:, order[r], :size] = m[:, k]
            valid[:, order[r], :size] = v[:, k]
        ces.append(ce)
        weights.append(v.sum(axis=(1, 2)))
    w = np.asarray(weights, np.float64)
    ce = (np.asarray(ces) * w).sum(0) / np.maximum(w.sum(0), 1)
    return {**chain_stats(match, valid), "ce": [float(c) for c in ce], "positions": int(valid[0].sum())}


# ============================================================================================ run
_RUN_KEYS = ("kind", "data", "target", "steps", "batch", "bucket", "lr", "warmup", "weight_decay", "clip", "unroll",
             "init_layer", "draft_vocab", "loss_vocab", "feature_layers", "ce_weight", "reg_weight", "step_decay",
             "seed", "max_len", "corpus", "corpus_blocks", "loss", "features", "init_head")


def train(args) -> dict:
    """The training run described by the parsed arguments (see `parse_args`). Returns the final summary."""
    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset, require_dataset

    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["data"] = os.path.abspath(run["data"]) if run["data"] else None
    run["corpus"] = [os.path.abspath(c) for c in run["corpus"] or ()]
    run["init_head"] = os.path.abspath(run["init_head"]) if run["init_head"] else None
    run["feature_layers"] = list(run["feature_layers"] or ())
    if args.corpus:
        from specjax.train.corpus import shard_hashes

        run["corpus_shards"] = shard_hashes(args.corpus, args.corpus_blocks)
    if not args.corpus:
        require_dataset(args.data)
    check_run(args.out, run, HeadTrainError)
    if args.corpus:
        return train_on_corpus(args)

    t_start = time.perf_counter()
    arrays, meta = load_dataset(args.data)
    if args.max_len:
        arrays = truncate(arrays, args.max_len)
    target = load_model(args.target, "float32", with_tokenizer=False)
    tcfg, tparams = target.config, target.params
    V = tcfg.vocab_size
    layers = tuple(args.feature_layers or default_eagle3_layers(tcfg.num_layers))
    train_rows = np.flatnonzero(~arrays["heldout"])
    eval_rows = np.flatnonzero(arrays["heldout"] & (arrays["temperature"] == 0))
    if train_rows.size == 0:
        raise HeadTrainError(f"{args.data}: no training sequences (every row is held out)")
    cache_path = args.features_cache or os.path.join(args.out, "features.npz")
    feats = load_or_compute_features(cache_path, args.data, args.target, tparams, tcfg, arrays, layers, args.progress,
                                     args.max_len)
    t_feats = time.perf_counter() - t_start
    if args.features_only:
        return {"features": cache_path, "seconds": round(t_feats, 1), "positions": int(arrays["length"].sum())}

    cfg, params, draft_ids, vocab, frozen, frozen_eval = build_head(
        args, tcfg, tparams, layers, lambda size: cached_array(os.path.join(args.out, "vocab.npy"), lambda: select_vocab(
            arrays, size, V, always=always_ids(meta), rows=train_rows)))
    if args.kind == "eagle":
        targets = position_targets(arrays, V, None if vocab.size == V else vocab)
        targets_eval = position_targets(arrays, V, None)
    else:
        targets = targets_eval = position_targets(arrays, V, vocab)
    del target

    L = arrays["tokens"].shape[1]
    lengths = arrays["length"][train_rows]
    per_epoch = len(make_batches(lengths, args.batch, args.bucket, args.seed, 0, L))

    def batch_at(step):
        epoch, k = divmod(step, per_epoch)
        idx, size = make_batches(lengths, args.batch, args.bucket, args.seed, epoch, L)[k]
        return host_batch(arrays, feats, targets, train_rows[idx], size, args.kind)

    def record(s):
        cnt = np.maximum(s["count"], 1)
        return {"loss": float(np.sum(s["loss"]) / np.sum(cnt)), "ce": (s["ce"] / cnt).tolist(),
                "reg": (s["reg"] / cnt).tolist(), "top1": (s["top1"] / cnt).tolist()}

    def run_eval(p, step, final):
        # EAGLE-1/2: intermediate evaluations read the loss vocabulary's LM head columns (cheap), the final one
        # the full LM head, as at inference.
        if eval_rows.size == 0:
            return None
        fz, tg = (frozen_eval, targets_eval) if final else (frozen, targets)
        ev = evaluate(p, fz, cfg, arrays, feats, tg, eval_rows, args.eval_unroll, args.eval_batch, args.bucket)
        return {"vocab": "full" if final or fz is frozen_eval else "loss", **ev}

    res = _fit(args, cfg, params, frozen, batch_at, record, run_eval)

    final_eval = last_eval(res.history)
    trains = split_history(res.history)[0]
    summary = {
        "kind": args.kind, "steps": args.steps, "train_sequences": int(train_rows.size),
        "heldout_sequences": int(eval_rows.size), "vocab": int(vocab.size), "feature_layers": list(layers),
        "final_train_loss": train_mean(res.history, "loss"), "final_train_top1": train_mean(res.history, "top1"),
        "train_seconds": round(trains[-1]["seconds"], 1) if trains else 0.0,
        "feature_seconds_this_run": round(t_feats, 1), "heldout": final_eval,
    }
    return _export(args, cfg, res, draft_ids, final_eval, summary)


def build_head(args, tcfg, tparams: dict, layers: tuple, vocab_of_size):
    """The head both trainers start from and the frozen target pieces its loss reads.

    vocab_of_size(n) -> the n most frequent training ids [n] (the EAGLE-3 draft vocabulary, or EAGLE-1/2's loss
    vocabulary). With --init-head the head's weights (and an EAGLE-3 head's draft vocabulary) come from that
    head instead of the target: a warm start, e.g. a shipped head trained further on a larger corpus.
    Returns (cfg, params without draft_ids, draft_ids [Vd] or None, vocab [Vo], frozen, frozen_eval): frozen holds
    the target's embedding and (EAGLE-1/2) its LM head columns of the loss vocabulary, frozen_eval the whole LM
    head, which evaluation reads as inference does."""
    V = tcfg.vocab_size
    if args.init_head:
        cfg, params = warm_start(args.init_head, args.kind, tcfg, layers if args.feature_layers else None)
        vocab = params["draft_ids"] if args.kind == "eagle3" else vocab_of_size(min(args.loss_vocab or V, V))
    else:
        vocab = vocab_of_size(min(args.draft_vocab if args.kind == "eagle3" else (args.loss_vocab or V), V))
        cfg = head_config(tcfg, args.kind, draft_vocab_size=vocab.size if args.kind == "eagle3" else 0,
                          feature_layers=layers if args.kind == "eagle3" else None)
        params = init_from_target(cfg, tparams, args.init_layer, draft_ids=vocab if args.kind == "eagle3" else None)
    draft_ids = params.pop("draft_ids", None)
    embed = tparams["embed"]
    full_head = tparams["lm_head"] if "lm_head" in tparams else embed.T
    if args.kind == "eagle":
        # Training reads the LM head columns of the loss vocabulary only; evaluation reads all of them.
        frozen = {"embed": embed, "lm_head": jnp.take(full_head, jnp.asarray(vocab), axis=1)}
        return cfg, params, draft_ids, np.asarray(vocab), frozen, {"embed": embed, "lm_head": full_head}
    frozen = {"embed": embed}
    return cfg, params, draft_ids, np.asarray(vocab), frozen, frozen


def warm_start(path: str, kind: str, tcfg, layers: tuple | None) -> tuple[HeadConfig, dict]:
    """(config, float32 params) of the head at `path`, checked against the run: same kind, the target's width
    and vocabulary, and the asked feature layers (None = whichever the head reads)."""
    from specjax.heads.eagle_io import load_head

    cfg, params = load_head(path, tcfg)
    if not isinstance(cfg, HeadConfig) or cfg.kind != kind:
        raise HeadTrainError(f"--init-head {path}: a {getattr(cfg, 'kind', type(cfg).__name__)!r} head cannot start "
                             f"a {kind!r} run; give a head of the same kind")
    if layers is not None and cfg.kind == "eagle3" and tuple(cfg.feature_layers) != tuple(layers):
        raise HeadTrainError(f"--init-head {path}: the head fuses target layers {list(cfg.feature_layers)}, the run "
                             f"asks for {list(layers)}; drop --feature-layers or give a matching head")
    params = jax.tree.map(lambda a: jnp.array(a, jnp.int32 if np.asarray(a).dtype.kind in "iu" else jnp.float32),
                          params)
    return cfg, params


def _fit(args, cfg: HeadConfig, params, frozen, batch_at, record, run_eval):
    """The one training loop (`loop.fit`) with this trainer's step, whichever data source feeds it."""
    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    step = functools.partial(update, cfg=cfg, optimizer=optimizer, unroll=args.unroll, ce_weight=args.ce_weight,
                             reg_weight=args.reg_weight, step_decay=args.step_decay, loss_kind=args.loss)
    return fit(step, params, optimizer, schedule, frozen, batch_at, out=args.out, steps=args.steps,
               checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, record=record, evaluate=run_eval,
               describe=lambda ev: f"held-out top1 {[round(a, 3) for a in ev['top1']]} "
                                   f"alpha {[round(a, 3) for a in ev['alpha']]} tau(chain) {ev['tau_chain']:.2f}",
               show=("loss", "top1"), progress=args.progress, desc=f"train {args.kind}", lr=args.lr,
               error=HeadTrainError, stop_at=args.stop_at)


def _export(args, cfg: HeadConfig, res, draft_ids, final_eval, summary: dict, **meta) -> dict:
    """Write the trained head (OUT/head or --export), its curves and OUT/summary.json; return the summary."""
    from specjax.heads.eagle_io import save_head

    export = args.export or os.path.join(args.out, "head")
    params = jax.device_get(res.params)
    params = params if draft_ids is None else dict(params, draft_ids=draft_ids)
    meta_out = {"target": args.target, "steps": args.steps, "unroll": args.unroll, "loss": args.loss, **meta,
                "heldout_top1": final_eval["top1"] if final_eval else None,
                "heldout_alpha": final_eval["alpha"] if final_eval else None}
    save_head(export, cfg, params, meta=meta_out)
    plot_curves(res.history, os.path.join(export, "training_curve.png"), args.kind)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _mesh(n: int):
    """A 1-D data-parallel mesh over the first n devices (None for n <= 1)."""
    if n <= 1:
        return None
    devs = jax.devices()
    if len(devs) < n:
        raise HeadTrainError(f"--mesh {n} needs {n} devices, this process has {len(devs)} (on a CPU, set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting)")
    return jax.sharding.Mesh(np.asarray(devs[:n]), ("data",))


def train_on_corpus(args) -> dict:
    """`train` over token shards (`--corpus`): streamed batches, features recorded or computed online, the
    target's soft targets computed on device, optionally data parallel over a device mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as PS

    from specjax.models.loading import load_model
    from specjax.train.corpus import (CorpusBatches, count_tokens, device_targets, open_for_target,
                                      recorded_features, t2o_table, vocab_from_counts)

    target = load_model(args.target, "float32")
    tcfg, tparams, tok = target.config, target.params, target.tokenizer
    corpora = open_for_target(args.corpus, target, args.corpus_blocks)
    V = tcfg.vocab_size
    always = sorted({0, 1, 2, *tok.stop_token_ids})
    cfg, params, draft_ids, vocab, frozen, frozen_eval = build_head(
        args, tcfg, tparams, tuple(args.feature_layers or default_eagle3_layers(tcfg.num_layers)),
        lambda size: vocab_from_counts(cached_array(os.path.join(args.out, "token_counts.npy"),
                                                    lambda: count_tokens(corpora, V, "train")), size, always))
    # A warm-started head reads its own layers; recorded features only serve a run that reads the same ones.
    layers = tuple(cfg.feature_layers or args.feature_layers or default_eagle3_layers(tcfg.num_layers))
    want = [str(x) for x in ("final",) + layers]
    online = args.features == "online" or (args.features == "auto" and not recorded_features(corpora, want))
    if not online:
        for c in corpora:
            if c.manifest.get("features") != want:
                raise HeadTrainError(f"{c.root}: its recorded features are {c.manifest.get('features')}, this run "
                                     f"needs {want}; use --features online or the corpus's layers")
        if not recorded_features(corpora, want):
            raise HeadTrainError(f"--features recorded: not every selected shard of {', '.join(args.corpus)} has "
                                 "its feature file here (a committed corpus keeps them local); select the blocks "
                                 "recorded on this machine with --corpus-blocks, or use --features online")
    t2o = jnp.asarray(t2o_table(V, None if vocab.size == V else vocab))
    ids = jnp.asarray(vocab)
    vocab_eval = (jnp.arange(V, dtype=jnp.int32), jnp.asarray(t2o_table(V, None))) if args.kind == "eagle" \
        else (ids, t2o)
    mesh = _mesh(args.mesh)
    if mesh is not None and args.batch % args.mesh:
        raise HeadTrainError(f"--batch {args.batch} must be a multiple of --mesh {args.mesh}")
    put_batch = (lambda b: b) if mesh is None else (lambda b: jax.device_put(b, NamedSharding(mesh, PS("data"))))
    if mesh is not None:
        rep = NamedSharding(mesh, PS())
        params, frozen, frozen_eval, tparams = jax.device_put((params, frozen, frozen_eval, tparams), rep)
    loader = CorpusBatches(corpora, batch=args.batch, bucket=args.bucket, max_len=args.max_len or 0, seed=args.seed,
                           split="train", features=not online)

    def head_batch(hb: dict, vocab_tables) -> dict:
        d = device_targets(tparams, tcfg, put_batch(hb), *vocab_tables, layers=layers, top_k=16, online=online)
        out = {k: d[k] for k in ("tokens", "soft_idx", "soft_p", "greedy", "mask")}
        out["feats"] = d["final"] if args.kind == "eagle" else d["layers"]
        if args.kind == "eagle":
            out["final"] = d["final"]
        return out

    tokens_seen = [0]

    def batch_at(step):
        hb = loader.batch_at(step)
        tokens_seen[0] += int(hb["length"].sum())
        return head_batch(hb, (ids, t2o))

    def record(s):
        cnt = np.maximum(s["count"], 1)
        return {"loss": float(np.sum(s["loss"]) / np.sum(cnt)), "ce": (s["ce"] / cnt).tolist(),
                "tv": (s["tv"] / cnt).tolist(), "top1": (s["top1"] / cnt).tolist()}

    def run_eval(p, step, final):
        held = CorpusBatches(corpora, batch=args.eval_batch, bucket=args.bucket, max_len=args.max_len or 0,
                             seed=0, split="heldout", features=not online)
        matches, valids, accepts = [], [], []
        it = held._epoch(0)
        for _, hb in zip(range(args.eval_batches), it):
            hb = dict(hb, length=np.where(hb["temperature"] == 0, hb["length"], 0))  # greedy answers only
            fz, tb = (frozen_eval, vocab_eval) if final else (frozen, (ids, t2o))
            m, v, _, a = jax.device_get(eval_matches(p, fz, cfg, head_batch(hb, tb), args.eval_unroll))
            matches.append(m.reshape(m.shape[0], -1))
            valids.append(v.reshape(v.shape[0], -1))
            accepts.append(a.reshape(a.shape[0], -1))
        if not matches:
            return None
        valid = np.concatenate(valids, 1)[:, None]
        st = chain_stats(np.concatenate(matches, 1)[:, None], valid)
        return {"vocab": "full" if final and args.kind == "eagle" else "head", **st,
                **sampled_acceptance(np.concatenate(accepts, 1)[:, None], valid),
                "positions": int(sum(v[0].sum() for v in valids))}

    res = _fit(args, cfg, params, frozen, batch_at, record, run_eval)
    final_eval = last_eval(res.history)
    trains = split_history(res.history)[0]
    secs = res.seconds
    totals = [c.totals() for c in corpora]
    summary = {
        "kind": args.kind, "steps": args.steps, "loss": args.loss, "features": "online" if online else "recorded",
        "mesh": args.mesh, "corpus": {c.root: t for c, t in zip(corpora, totals)}, "vocab": int(vocab.size),
        "feature_layers": list(layers), "final_train_loss": train_mean(res.history, "loss"),
        "final_train_top1": train_mean(res.history, "top1"),
        "train_seconds": round(trains[-1]["seconds"], 1) if trains else 0.0,
        "train_tokens_per_s_this_run": round(tokens_seen[0] / secs, 1) if secs > 0 else None,
        "heldout": final_eval,
    }
    return _export(args, cfg, res, draft_ids, final_eval, summary,
                   corpus=[os.path.basename(os.path.normpath(c)) for c in args.corpus])


def plot_curves(history: list[dict], path: str, kind: str) -> None:
    """Loss and top-1 agreement per unroll step (train smoothed, held-out points) to a PNG."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    tr, ev = split_history(history)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.2))
    if tr:
        a1.plot(*smoothed(tr, [r["loss"] for r in tr], 40), label="train loss (smoothed)")
        ce, t1 = np.asarray([r["ce"] for r in tr]), np.asarray([r["top1"] for r in tr])
        for j in range(ce.shape[1]):
            a1.plot(*smoothed(tr, ce[:, j], 40), lw=0.8, label=f"train CE step {j}")
        for j in range(t1.shape[1]):
            a2.plot(*smoothed(tr, t1[:, j], 40), label=f"step {j}")
    if ev:
        es = [r["step"] for r in ev]
        t1, al = np.asarray([r["top1"] for r in ev]), np.asarray([r["alpha"] for r in ev])
        for j in range(t1.shape[1]):
            a3.plot(es, t1[:, j], "o-", label=f"top-1 step {j}")
            a3.plot(es, al[:, j], "x--", lw=0.8, label=f"alpha step {j}")
    a1.set(xlabel="step", ylabel="loss", title=f"{kind}: training loss")
    a2.set(xlabel="step", ylabel="top-1 agreement", title="train top-1 per unroll step")
    a3.set(xlabel="step", ylabel="rate", title="held-out top-1 and chain acceptance per step")
    save_figure(plt, fig, (a1, a2, a3), path, fontsize=7)


def _layers_arg(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--feature-layers wants three comma-separated integers like 1,14,26, "
                                         f"got {text!r}") from None
    if len(out) != 3:
        raise argparse.ArgumentTypeError(f"--feature-layers wants three layers (low, mid, high), got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also read by `specjax train-head` to check YAML keys)."""
    ap = argparse.ArgumentParser(prog="python -m specjax.train.eagle",
                                 description="Train an EAGLE-1/2 or EAGLE-3 head on self-distillation data; rerun "
                                             "the same command to resume.")
    ap.add_argument("--kind", choices=("eagle", "eagle3"), required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help=".npz from `python -m specjax.train.data` (small, in-memory)")
    src.add_argument("--corpus", nargs="+", help="token-shard corpus directories from `python -m "
                                                 "specjax.train.generate` (streamed), e.g. OUT/responses")
    ap.add_argument("--features", choices=("auto", "recorded", "online"), default="auto",
                    help="--corpus: target features from the corpus (recorded) or the target's forward in each step "
                         "(online); auto = recorded when every corpus has them")
    add_corpus_blocks_arg(ap)
    ap.add_argument("--loss", choices=LOSSES, default="kl", help="distribution-matching loss (see step_losses)")
    ap.add_argument("--mesh", type=int, default=1, help="data-parallel devices (the batch is split over them)")
    ap.add_argument("--eval-batches", type=int, default=32, help="--corpus: held-out batches per evaluation")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics, exported head)")
    ap.add_argument("--export", default=None, help="where to write the head (default OUT/head)")
    ap.add_argument("--features-cache", default=None,
                    help="target feature cache (.npz), shareable between runs on the same data (default OUT/features.npz)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--max-len", type=int, default=0, help="use only the first N tokens of each sequence (0 = all)")
    ap.add_argument("--features-only", action="store_true",
                    help="compute (or check) the feature cache and stop; run it once before parallel trainings")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=64, help="sequence lengths are padded to a multiple of this")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--unroll", type=int, default=None,
                    help="unroll steps in training (default 2 for eagle, 4 for eagle3: training-time test)")
    ap.add_argument("--eval-unroll", type=int, default=5, help="unroll steps measured on the held-out split")
    ap.add_argument("--init-layer", type=int, default=-1, help="target layer the head's decoder layer starts from")
    ap.add_argument("--init-head", default=None,
                    help="start from this head's weights (a directory in any supported head format, e.g. a shipped "
                         "head) instead of the target's layer; an EAGLE-3 head keeps its draft vocabulary")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="eagle3: draft vocabulary size")
    ap.add_argument("--loss-vocab", type=int, default=8192,
                    help="eagle: tokens the training cross-entropy normalises over (0 = the full vocabulary)")
    ap.add_argument("--feature-layers", type=_layers_arg, default=None,
                    help="eagle3: target layers (outputs) fused as low,mid,high (default: the EAGLE-3 choice)")
    ap.add_argument("--ce-weight", type=float, default=None, help="cross-entropy weight (default 0.1 eagle, 1 eagle3)")
    ap.add_argument("--reg-weight", type=float, default=1.0, help="eagle: feature regression weight")
    ap.add_argument("--step-decay", type=float, default=0.8, help="weight of unroll step j is step_decay**j")
    add_loop_options(ap, checkpoint_every=50, eval_every=100, eval_batch=8)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.unroll is None:
        args.unroll = 2 if args.kind == "eagle" else 4
    if args.ce_weight is None:
        args.ce_weight = 0.1 if args.kind == "eagle" else 1.0
    if min(args.steps, args.batch, args.bucket, args.checkpoint_every, args.eval_every, args.unroll,
           args.eval_unroll) < 1:
        ap.error("--steps, --batch, --bucket, --checkpoint-every, --eval-every, --unroll and --eval-unroll must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    return report(train(parse_args(argv)), hide=())


if __name__ == "__main__":
    main()
