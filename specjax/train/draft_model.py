"""Distil a small draft model from its target (the draft format itself: `specjax.models.draft_io`).

The draft is a few Llama layers of the target's width that share the target's embedding; its head is the
embedding rows of a reduced draft vocabulary `d2t` (see `specjax.models.draft_io`).

Training: layers initialised from chosen target layers (or, with --init-draft, from an existing draft, whose
d2t is kept), trained with AdamW (warmup + cosine) on the target's answers against its distribution restricted
to the draft vocabulary, plus an optional cross-entropy on the target's greedy token. Two data sources:

  --data FILE.npz    self-distillation data in memory (`specjax.train.data`): the target's top-k at each
                     response step was recorded at generation.
  --corpus DIR ...   token shards (`specjax.train.generate`), streamed (`specjax.train.corpus.CorpusBatches`):
                     the soft targets come from the target's forward on device in each step
                     (`specjax.train.corpus.device_targets`); the draft vocabulary is the training split's most
                     frequent response tokens, the held-out evaluation reads the greedy answers of the held-out
                     split, and a resumed run refuses a corpus whose shards changed.

The loop is `specjax.train.loop.fit`: orbax checkpoints every N steps, and rerunning the same command resumes
from the last one. Run: `python -m specjax.train.draft_model --data FILE | --corpus DIR --out DIR --steps N`.
"""
from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kv_cache import init_cache
from specjax.models.draft_io import DraftError, draft_config, load_draft, save_draft
from specjax.models.llama import LlamaConfig, forward
from specjax.train.common import always_ids, cached_array, check_run, select_vocab
from specjax.train.corpus import add_corpus_blocks_arg
from specjax.train.loop import add_loop_options, apply_gradients, fit, last_eval, make_optimizer, pyplot_or_none, \
    report, save_figure, smoothed, split_history, train_mean

# The draft's output vocabulary (d2t): the target ids it predicts, chosen from the training data.
select_draft_vocab = select_vocab


# ============================================================================================ training data
def build_targets(arrays: dict, d2t: np.ndarray, vocab_size: int, rows=None) -> dict[str, np.ndarray]:
    """Per-response-step training targets for the sequences `rows` (default all).

    Only response steps get a loss, so targets are laid out per step i (R = max response length), and
    `pos` says which input position predicts it (prompt_len - 1 + i): the head runs on those positions only.
    Returns tokens [N, L] int32, length [N] int32, pos [N, R] int32, mask [N, R] bool (step exists);
    soft_idx [N, R, K] int32 (draft index of each target top-k entry, 0 where absent), soft_p [N, R, K]
    float32 (its probability, renormalised over the entries inside the draft vocabulary, 0 elsewhere);
    greedy_idx [N, R] int32 (draft index of the target's greedy token, -1 outside the draft vocabulary
    or the response); greedy_id [N, R] int32 (that token's target id).
    """
    rows = np.arange(arrays["tokens"].shape[0]) if rows is None else np.asarray(rows)
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[d2t] = np.arange(d2t.size, dtype=np.int32)
    plen = arrays["prompt_len"][rows].astype(np.int32)
    n_resp = (arrays["length"][rows] - plen).astype(np.int32)
    ids = arrays["topk_ids"][rows]  # [N, R, K]
    R = ids.shape[1]
    mask = np.arange(R)[None, :] < n_resp[:, None]
    d = t2d[ids]
    prob = np.exp(arrays["topk_logp"][rows].astype(np.float32)) * (d >= 0) * mask[..., None]
    prob /= np.maximum(prob.sum(-1, keepdims=True), 1e-30)
    greedy_id = np.where(mask, ids[..., 0], 0).astype(np.int32)
    return {
        "tokens": arrays["tokens"][rows].astype(np.int32),
        "length": arrays["length"][rows].astype(np.int32),
        "pos": np.where(mask, plen[:, None] - 1 + np.arange(R)[None, :], 0).astype(np.int32),
        "mask": mask, "soft_idx": np.maximum(d, 0).astype(np.int32), "soft_p": prob.astype(np.float32),
        "greedy_idx": np.where(mask, t2d[greedy_id], -1).astype(np.int32), "greedy_id": greedy_id,
    }


def make_batches(length: np.ndarray, batch: int, bucket: int, seed: int, epoch: int) -> list[tuple[np.ndarray, int]]:
    """One epoch of batches as (row indices [batch], padded length), a pure function of (seed, epoch).

    Rows are grouped by length rounded up to `bucket` so short sequences are not padded to the longest one
    (few distinct shapes, so few compiles); a bucket's last batch is filled up by wrapping around it.
    """
    rng = np.random.default_rng([seed, epoch])
    padded = -(-length // bucket) * bucket
    out = []
    for size in np.unique(padded):
        members = rng.permutation(np.flatnonzero(padded == size))
        for s in range(0, members.size, batch):
            idx = members[np.arange(s, s + batch) % members.size]
            out.append((idx, int(size)))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def device_batch(targets: dict, idx: np.ndarray, size: int) -> dict:
    """Rows `idx` of the targets with tokens cropped to `size`, as jax arrays (host-only fields dropped)."""
    b = {k: v[idx] for k, v in targets.items() if k not in ("greedy_id", "length")}
    b["tokens"] = b["tokens"][:, :size]
    return {k: jnp.asarray(v) for k, v in b.items()}


# ============================================================================================ model and loss
def init_from_target(target_params: dict, layers: tuple[int, ...]) -> dict:
    """Trainable draft params {"layers", "final_norm"} copied from the given target layers and final norm."""
    n = len(target_params["layers"])
    bad = [i for i in layers if not -n <= i < n]
    if bad or not layers:
        raise DraftError(f"--init-layers {list(layers)}: give one or more target layer indices in [-{n}, {n})")
    copy = lambda a: jnp.array(a, jnp.float32)
    return {"layers": [jax.tree_util.tree_map(copy, dict(target_params["layers"][i])) for i in layers],
            "final_norm": copy(target_params["final_norm"])}


def draft_logits(train: dict, frozen: dict, config: LlamaConfig, tokens: jax.Array, pos: jax.Array) -> jax.Array:
    """Teacher-forced draft logits [B, R, Vd] at input positions pos [B, R] of tokens [B, T].

    frozen = {"embed" [V, H], "head" [H, Vd]}. The layers run causally over all T tokens; the head only at
    `pos` (the response), which is where the loss is.
    """
    B, T = tokens.shape
    params = {"embed": frozen["embed"], "layers": train["layers"], "final_norm": train["final_norm"]}
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, frozen["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden = forward(params, config, tokens, positions, cache, compute_logits=False).hidden
    hidden = jnp.take_along_axis(hidden, jnp.clip(pos, 0, T - 1)[..., None], axis=1)
    return jnp.matmul(hidden, frozen["head"], preferred_element_type=jnp.float32)


def position_losses(train: dict, frozen: dict, config: LlamaConfig, batch: dict, hard_weight: float):
    """Per-step loss [B, R] (soft cross-entropy to the target's top-k + hard_weight * CE on its greedy
    token; zero outside the mask) and match [B, R] (draft argmax == target greedy token, inside the mask)."""
    logits = draft_logits(train, frozen, config, batch["tokens"], batch["pos"])
    logq = jax.nn.log_softmax(logits, axis=-1)
    soft = -jnp.sum(batch["soft_p"] * jnp.take_along_axis(logq, batch["soft_idx"], axis=-1), axis=-1)
    g = batch["greedy_idx"]
    hard = -jnp.take_along_axis(logq, jnp.maximum(g, 0)[..., None], axis=-1)[..., 0] * (g >= 0)
    m = batch["mask"]
    return jnp.where(m, soft + hard_weight * hard, 0.0), (jnp.argmax(logits, axis=-1) == g) & m


def loss_and_metrics(train: dict, frozen: dict, config: LlamaConfig, batch: dict, hard_weight: float):
    """Masked mean loss. Returns (loss, {"loss", "agree"}): agree = fraction of masked positions where the
    draft's argmax is the target's greedy token."""
    loss, match = position_losses(train, frozen, config, batch, hard_weight)
    count = jnp.maximum(jnp.sum(batch["mask"]), 1).astype(jnp.float32)
    loss = jnp.sum(loss) / count
    return loss, {"loss": loss, "agree": jnp.sum(match) / count}


def update(train: dict, opt_state, frozen: dict, batch: dict, *, config: LlamaConfig, optimizer, hard_weight: float):
    """One AdamW step (pure): (train params, optimizer state, metrics {"loss", "agree"})."""
    return apply_gradients(loss_and_metrics, optimizer, train, opt_state, frozen, config, batch, hard_weight)


# The same step jitted on its own (params and optimizer state donated), for callers outside `fit`.
train_step = jax.jit(update, static_argnames=("config", "optimizer", "hard_weight"), donate_argnums=(0, 1))
eval_step = jax.jit(position_losses, static_argnames=("config", "hard_weight"))


def chain_acceptance(match: np.ndarray, mask: np.ndarray, depth: int = 8) -> dict:
    """Greedy chain speculation statistics from teacher-forced matches on greedy target text.

    match/mask [N, L] bool. Drafting k tokens from position t, draft j (0-based) is accepted iff drafts
    0..j all equal the target's greedy tokens; on greedy target text the draft's context is exactly the
    accepted prefix, so teacher forcing gives the real chain outcome. Returns alpha[j] = P(draft j accepted |
    drafts before it accepted; None when no start reaches it) and tau[k] = expected tokens per verify step
    with k drafts (accepted + 1), each over the start positions whose k-th draft lies inside the response.
    """
    N, L = match.shape
    alpha, tau = [], {}
    run = np.ones((N, L), bool)  # run[t]: drafts 0..j-1 from start t all matched
    survive = []  # survive[j][t]: drafts 0..j matched
    for j in range(depth):
        ok = np.zeros((N, L), bool)
        ok[:, :L - j] = match[:, j:] & mask[:, j:]
        valid = np.zeros((N, L), bool)
        valid[:, :L - j] = mask[:, j:] & mask[:, :L - j]
        now = run & ok
        den = np.sum(run & valid)
        alpha.append(float(np.sum(now & valid) / den) if den else None)  # None: no such start (JSON-safe)
        survive.append(now)
        run = now
    for k in range(1, depth + 1):
        valid = np.zeros((N, L), bool)
        valid[:, :L - k + 1] = mask[:, k - 1:] & mask[:, :L - k + 1]
        tau[k] = float(1 + sum(np.sum(survive[j] & valid) for j in range(k)) / max(np.sum(valid), 1))
    return {"alpha": alpha, "tau": tau}


def evaluate(train: dict, frozen: dict, config: LlamaConfig, targets: dict, batch: int, hard_weight: float,
             depth: int = 8) -> dict:
    """Held-out loss, top-1 agreement with the target's greedy token, and greedy chain acceptance."""
    N = targets["tokens"].shape[0]
    losses, matches = [], []
    for s in range(0, N, batch):
        idx = np.arange(s, s + batch) % N  # wrap to keep one shape; the repeated rows are dropped below
        loss, match = eval_step(train, frozen, config, device_batch(targets, idx, targets["tokens"].shape[1]),
                                hard_weight)
        keep = min(batch, N - s)
        losses.append(np.asarray(loss)[:keep])
        matches.append(np.asarray(match)[:keep])
    count = float(np.sum(targets["mask"]))
    match = np.concatenate(matches)
    in_vocab = float(np.sum((targets["greedy_idx"] >= 0) & targets["mask"]) / max(count, 1))
    return {"loss": float(np.sum(np.concatenate(losses)) / max(count, 1)),
            "agree": float(np.sum(match) / max(count, 1)), "positions": int(count),
            "greedy_in_draft_vocab": in_vocab, **chain_acceptance(match, targets["mask"], depth)}


# ============================================================================================ run
_RUN_KEYS = ("data", "init_layers", "draft_vocab", "batch", "bucket", "steps", "lr", "warmup", "weight_decay", "hard_weight",
             "seed", "target")


def train(args) -> dict:
    """The training run described by the parsed arguments (see `main`). Returns the final summary."""
    from specjax.train.data import require_dataset

    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["init_layers"] = list(run["init_layers"])
    run["data"] = os.path.abspath(run["data"]) if run["data"] else None
    # Keys a run from before these options never recorded are None there too, so such a run still resumes.
    run["init_draft"] = os.path.abspath(args.init_draft) if args.init_draft else None
    run["corpus"] = [os.path.abspath(c) for c in args.corpus] if args.corpus else None
    if args.corpus:
        from specjax.train.corpus import shard_hashes

        run.update(corpus_shards=shard_hashes(args.corpus, args.corpus_blocks), corpus_blocks=args.corpus_blocks, max_len=args.max_len)
    if not args.corpus:
        require_dataset(args.data)
    check_run(args.out, run, DraftError)
    if args.corpus:
        return train_on_corpus(args)

    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset

    arrays, meta = load_dataset(args.data)
    target = load_model(args.target, "float32", with_tokenizer=False)
    tcfg, tparams = target.config, target.params
    V = tcfg.vocab_size
    train_rows = np.flatnonzero(~arrays["heldout"])
    eval_rows = np.flatnonzero(arrays["heldout"])
    if train_rows.size == 0:
        raise DraftError(f"{args.data}: no training sequences (every row is held out)")
    config, params, d2t = initial_draft(args, tcfg, tparams, lambda size: select_draft_vocab(
        arrays, size, V, always=always_ids(meta), rows=train_rows))
    frozen = {"embed": tparams["embed"], "head": jnp.take(tparams["embed"], jnp.asarray(d2t), axis=0).T}
    train_t = build_targets(arrays, d2t, V, train_rows)
    eval_t = build_targets(arrays, d2t, V, eval_rows) if eval_rows.size else None
    del tparams, target

    per_epoch = len(make_batches(train_t["length"], args.batch, args.bucket, args.seed, 0))

    def batch_at(step):
        epoch, k = divmod(step, per_epoch)
        idx, size = make_batches(train_t["length"], args.batch, args.bucket, args.seed, epoch)[k]
        return device_batch(train_t, idx, size)

    def run_eval(p, step, final):
        return None if eval_t is None else evaluate(p, frozen, config, eval_t, args.eval_batch, args.hard_weight)

    res = _fit(args, config, params, frozen, batch_at, run_eval)
    summary = {
        "steps": args.steps, "train_sequences": int(train_t["tokens"].shape[0]),
        "heldout_sequences": int(eval_rows.size), "train_positions": int(train_t["mask"].sum()),
        "draft_vocab": int(d2t.size), "final_train_loss": train_mean(res.history, "loss"),
        "final_train_agree": train_mean(res.history, "agree"), "train_seconds_this_run": round(res.seconds, 1),
        "heldout": last_eval(res.history), "data_meta": meta,
    }
    return _export(args, config, frozen, res, d2t, summary, run_eval)


def train_on_corpus(args) -> dict:
    """`train` over token shards (`--corpus`): streamed batches whose soft targets (the target's top-k inside
    the draft vocabulary, its greedy token, the response mask) the target computes on device in each step."""
    from specjax.models.loading import load_model
    from specjax.train.corpus import CorpusBatches, SOFT_TOP_K, device_targets, heldout_batches, open_for_target, \
        t2o_table, tokenizer_always_ids, train_vocab

    target = load_model(args.target, "float32")
    tcfg, tparams = target.config, target.params
    corpora = open_for_target(args.corpus, target, args.corpus_blocks)
    V = tcfg.vocab_size
    always = tokenizer_always_ids(target.tokenizer)
    config, params, d2t = initial_draft(args, tcfg, tparams, lambda size: train_vocab(
        corpora, size, V, always, os.path.join(args.out, "token_counts.npy"), error=DraftError))
    frozen = {"embed": tparams["embed"], "head": jnp.take(tparams["embed"], jnp.asarray(d2t), axis=0).T}
    ids, t2o = jnp.asarray(d2t), jnp.asarray(t2o_table(V, d2t))
    top_k = min(SOFT_TOP_K, int(d2t.size))
    loader = CorpusBatches(corpora, batch=args.batch, bucket=args.bucket, max_len=args.max_len, seed=args.seed,
                           split="train")

    def targets(hb: dict) -> dict:
        return corpus_batch(device_targets(tparams, tcfg, hb, ids, t2o, layers=(), top_k=top_k, online=True))

    tokens_seen = [0]

    def batch_at(step):
        hb = loader.batch_at(step)
        tokens_seen[0] += int(hb["length"].sum())
        return targets(hb)

    held: list[list[dict]] = []  # the held-out batches' targets, computed at the first evaluation and kept

    def run_eval(p, step, final):
        if not held:
            held.append([targets(hb) for hb in heldout_batches(corpora, batch=args.eval_batch, bucket=args.bucket,
                                                                 max_len=args.max_len, limit=args.eval_batches)])
        return evaluate_batches(p, frozen, config, held[0], args.hard_weight) if held[0] else None

    res = _fit(args, config, params, frozen, batch_at, run_eval)
    secs = res.seconds
    summary = {
        "steps": args.steps, "corpus": {c.root: c.totals() for c in corpora}, "draft_vocab": int(d2t.size),
        "init_draft": args.init_draft, "final_train_loss": train_mean(res.history, "loss"),
        "final_train_agree": train_mean(res.history, "agree"), "train_seconds_this_run": round(secs, 1),
        "train_tokens_per_s_this_run": round(tokens_seen[0] / secs, 1) if secs > 0 else None,
        "heldout": last_eval(res.history),
    }
    return _export(args, config, frozen, res, d2t, summary, run_eval,
                   corpus=[os.path.basename(os.path.normpath(c)) for c in args.corpus])


def corpus_batch(d: dict) -> dict:
    """The loss's batch from `device_targets` output: every position p of tokens [B, T] is scored (pos [B, T]
    = p), its targets are those of token p + 1 (soft_idx / soft_p [B, T, K], greedy_idx [B, T], mask [B, T])."""
    B, T = d["tokens"].shape
    return {"tokens": d["tokens"], "pos": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
            "mask": d["mask"], "soft_idx": d["soft_idx"], "soft_p": d["soft_p"], "greedy_idx": d["greedy"]}


def evaluate_batches(train: dict, frozen: dict, config: LlamaConfig, batches: list[dict], hard_weight: float,
                     depth: int = 8) -> dict:
    """`evaluate` over device batches in the `corpus_batch` layout (rows of different widths are padded):
    held-out loss, top-1 agreement with the target's greedy token, and greedy chain acceptance."""
    T = max(b["tokens"].shape[1] for b in batches)
    total, matches, masks, greedy = 0.0, [], [], []
    for b in batches:
        loss, match = jax.device_get(eval_step(train, frozen, config, b, hard_weight))
        pad = lambda a, fill: np.pad(np.asarray(a), ((0, 0), (0, T - a.shape[1])), constant_values=fill)
        total += float(np.sum(loss))
        matches.append(pad(match, False))
        masks.append(pad(b["mask"], False))
        greedy.append(pad(b["greedy_idx"], -1))
    match, mask = np.concatenate(matches), np.concatenate(masks)
    count = float(mask.sum())
    in_vocab = float(np.sum((np.concatenate(greedy) >= 0) & mask) / max(count, 1))
    return {"loss": total / max(count, 1), "agree": float(match.sum() / max(count, 1)), "positions": int(count),
            "greedy_in_draft_vocab": in_vocab, **chain_acceptance(match, mask, depth)}


def warm_start(path: str, target_params: dict) -> tuple[LlamaConfig, dict, np.ndarray]:
    """(config, float32 {"layers", "final_norm"}, d2t [Vd]) of the draft at `path` (`load_draft`, which refuses a
    draft made for another target's width or vocabulary)."""
    config, p, d2t = load_draft(path, target_params, dtype=jnp.float32)
    return config, {"layers": p["layers"], "final_norm": p["final_norm"]}, np.asarray(d2t)


def initial_draft(args, tcfg: LlamaConfig, tparams: dict, vocab_of_size) -> tuple[LlamaConfig, dict, np.ndarray]:
    """(draft config, trainable params, d2t [Vd]) a run starts from: the target's --init-layers and the
    vocab_of_size(--draft-vocab) most frequent training ids, or with --init-draft that draft's weights and d2t.
    d2t is kept in OUT/d2t.npy, so a resumed run keeps its first choice."""
    if args.init_draft:
        config, params, d2t = warm_start(args.init_draft, tparams)
        return config, params, cached_array(os.path.join(args.out, "d2t.npy"), lambda: d2t)
    d2t = cached_array(os.path.join(args.out, "d2t.npy"), lambda: vocab_of_size(args.draft_vocab))
    return draft_config(tcfg, len(args.init_layers)), init_from_target(tparams, tuple(args.init_layers)), d2t


def _fit(args, config: LlamaConfig, params: dict, frozen: dict, batch_at, run_eval):
    """The one training loop (`loop.fit`) with this trainer's step, whichever data source feeds it."""
    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    return fit(functools.partial(update, config=config, optimizer=optimizer, hard_weight=args.hard_weight), params,
               optimizer, schedule, frozen, batch_at, out=args.out, steps=args.steps,
               checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
               record=lambda m: {"loss": float(m["loss"]), "agree": float(m["agree"])}, evaluate=run_eval,
               describe=lambda ev: f"held-out loss {ev['loss']:.3f} agree {ev['agree']:.3f} "
                                   f"alpha {[a if a is None else round(a, 3) for a in ev['alpha'][:5]]}",
               show=("loss", "agree"), progress=args.progress, desc="train", lr=args.lr, error=DraftError, stop_at=args.stop_at)


def _export(args, config: LlamaConfig, frozen: dict, res, d2t: np.ndarray, summary: dict, run_eval, **meta) -> dict:
    """Write the draft (OUT/draft or --export), its curve and OUT/summary.json; return the summary."""
    final_eval = summary["heldout"]
    export = args.export or os.path.join(args.out, "draft")
    save_draft(export, config, res.params, d2t,
               {"target": args.target, "steps": args.steps, "init_layers": list(args.init_layers),
                "heldout_top1_agreement": final_eval["agree"] if final_eval else None, **meta})
    plot_curve(res.history, os.path.join(export, "training_curve.png"))
    if final_eval is not None:
        # What ships is bf16: measure the exported weights themselves, as the drafter will load them.
        _, shipped, _ = load_draft(export, {"embed": frozen["embed"]})
        summary["heldout_exported"] = run_eval({"layers": shipped["layers"], "final_norm": shipped["final_norm"]},
                                               args.steps, True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def plot_curve(history: list[dict], path: str) -> None:
    """Training loss and top-1 agreement (smoothed) with the held-out evaluations, to a PNG."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    tr, ev = split_history(history)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if tr:
        a1.plot(*smoothed(tr, [r["loss"] for r in tr], 50), label="train (smoothed)")
        a2.plot(*smoothed(tr, [r["agree"] for r in tr], 50), label="train (smoothed)")
    if ev:
        a1.plot([r["step"] for r in ev], [r["loss"] for r in ev], "o-", label="held-out")
        a2.plot([r["step"] for r in ev], [r["agree"] for r in ev], "o-", label="held-out")
    a1.set(xlabel="step", ylabel="distillation loss (log scale)", title="loss", yscale="log")
    a2.set(xlabel="step", ylabel="top-1 agreement with target", title="top-1 agreement")
    save_figure(plt, fig, (a1, a2), path, dpi=100)


def _layers_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--init-layers wants comma-separated integers like 0,29, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also read by `specjax train-head` to check YAML keys)."""
    ap = argparse.ArgumentParser(prog="python -m specjax.train.draft_model",
                                 description="Distil a small draft model from the target; rerun to resume.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help=".npz from `python -m specjax.train.data` (small, in memory)")
    src.add_argument("--corpus", nargs="+", help="token-shard corpus directories from `python -m "
                                                 "specjax.train.generate` (streamed), e.g. OUT/responses")
    add_corpus_blocks_arg(ap)
    ap.add_argument("--max-len", type=int, default=0,
                    help="--corpus: use only the first N tokens of each sequence (0 = all)")
    ap.add_argument("--eval-batches", type=int, default=32, help="--corpus: held-out batches per evaluation")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics, d2t, exported draft)")
    ap.add_argument("--export", default=None, help="where to write the draft directory (default OUT/draft)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=64, help="sequence lengths are padded to a multiple of this")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--hard-weight", type=float, default=0.0, help="weight of the CE on the target's greedy token")
    ap.add_argument("--init-layers", type=_layers_arg, default=(0, -1),
                    help="target layers copied into the draft (their count is the draft depth)")
    ap.add_argument("--draft-vocab", type=int, default=12288)
    ap.add_argument("--init-draft", default=None,
                    help="start from this draft's weights (a directory of `specjax.models.draft_io`, e.g. a shipped "
                         "draft) instead of target layers; it keeps its d2t (--init-layers and --draft-vocab unused)")
    add_loop_options(ap, checkpoint_every=100, eval_every=200, eval_batch=8)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.bucket, args.checkpoint_every, args.eval_every, args.eval_batches) < 1:
        ap.error("--steps, --batch, --bucket, --checkpoint-every, --eval-every and --eval-batches must be >= 1")
    if args.max_len < 0 or (args.max_len and not args.corpus):
        ap.error("--max-len cuts the sequences of a --corpus (N >= 0); an .npz keeps its own lengths")
    return args


def main(argv: list[str] | None = None) -> dict:
    return report(train(parse_args(argv)))


if __name__ == "__main__":
    main()
