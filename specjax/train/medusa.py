"""Train Medusa heads for a target on its own generations (self-distillation data), in JAX.

Data: `.npz` files from `python -m specjax.train.data` (the target's answers to the project's own prompts, with
its top-k log-probabilities at every response step; never benchmark text). Held-out rows (`heldout`) are only
evaluated.

1. Features. One prefill-style target forward per batch of sequences (`specjax.train.features`) gives
   the final hidden state at every position; the response rows are cached in OUT/features.npy (float16), a
   memory map filled batch by batch, so an interrupted extraction continues where it stopped.
2. Targets. Feature row i of a sequence is the position that predicts response token i (the target's own LM
   head does that); head k (1..K) learns response token i + k: the hard token the target emitted there and the
   target's top-k distribution at that step (soft), both restricted to the draft vocabulary (`token_map`).
3. Heads (`specjax.heads.medusa`): K heads of residual blocks on the target's tied LM head, restricted to the
   Vd most frequent target tokens of the training data (`--draft-vocab`, 0 = full vocabulary). Only the blocks
   train. Loss per head: hard_weight * CE(hard) + (1 - hard_weight) * CE(soft); their mean over the heads.
4. The loop of `specjax.train.loop.fit`: AdamW with warmup + cosine decay, orbax checkpoints every
   `--checkpoint-every` steps (rerunning the same command resumes), a tqdm bar with the loss and each head's
   top-1 accuracy, metrics.jsonl, and at the end a held-out evaluation (top-k rank accuracy per head, which `drafters.medusa.choices_from_accuracy` turns into
   the default tree), the exported heads (specjax layout, bf16) and a PNG of the training curves.

Data from a token-shard corpus instead (`--corpus DIR ...`, `specjax.train.generate`): batches of whole
sequences are streamed (`specjax.train.corpus.CorpusBatches`), the final hidden state is read from the corpus's
recorded features or computed by the target in each step (`--features`), and the soft targets come from the
target's LM head on device (`specjax.train.corpus.device_targets`); every response position of a batch trains
(`corpus_head_batch`), the draft vocabulary is the training split's most frequent response tokens, the held-out
evaluation reads the greedy answers of the held-out split, and a resumed run refuses a corpus whose shards changed.

Run: python -m specjax.train.medusa --data DATA.npz | --corpus DIR --out DIR [--steps N ...]   (see --help)
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

from specjax.heads.medusa import MedusaConfig, head_hidden, head_logits, init_heads, target_lm_rows
from specjax.models.llama import LlamaConfig
from specjax.train.common import TrainError, always_ids, cached_array, check_run, progress_bar, select_vocab
from specjax.train.corpus import add_corpus_blocks_arg
from specjax.train.features import feature_cache_key, final_hidden, response_rows
from specjax.train.loop import add_loop_options, apply_gradients, fit, last_eval, make_optimizer, pyplot_or_none, \
    report, save_figure, smoothed, split_history, train_mean

EVAL_RANKS = 10  # ranks per head measured on held-out data (the default tree uses ranks below this)


class MedusaTrainError(TrainError):
    """Medusa training cannot run as asked; the message says how to fix it."""


# ============================================================================================ features


def extract_features(params: dict, config: LlamaConfig, arrays: dict, out_dir: str, *, batch: int = 8,
                     bucket: int = 64, progress: bool = True) -> np.ndarray:
    """Final hidden states of the response rows: [N, R, H] float16 memory map, row (n, i) = position
    prompt_len[n] - 1 + i (the one predicting response token i); zero past each response.

    Stored in out_dir/features.npy with a done mask (features_done.npy) updated after every batch, so rerunning
    computes only the missing sequences. Sequences are batched by length (padded to `bucket`) to limit compiles.
    """
    tokens, plen, length = arrays["tokens"], arrays["prompt_len"], arrays["length"]
    N = tokens.shape[0]
    R = arrays["topk_ids"].shape[1]
    H = config.hidden_size
    path, done_path = os.path.join(out_dir, "features.npy"), os.path.join(out_dir, "features_done.npy")
    if os.path.exists(path) and os.path.exists(done_path):
        feats = np.lib.format.open_memmap(path, mode="r+")
        if feats.shape != (N, R, H):
            raise MedusaTrainError(f"{path} has shape {feats.shape}, the data needs {(N, R, H)}; delete it to redo")
        done = np.load(done_path)
    else:
        feats = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(N, R, H))
        done = np.zeros(N, bool)
    todo = [n for n in np.argsort(length, kind="stable") if not done[n]]
    groups = []
    for n in todo:
        size = int(-(-length[n] // bucket) * bucket)
        if groups and groups[-1][0] == size and len(groups[-1][1]) < batch:
            groups[-1][1].append(n)
        else:
            groups.append((size, [n]))
    for size, rows in progress_bar(groups, progress, desc="features", unit="batch"):
        idx = rows + [rows[-1]] * (batch - len(rows))  # one batch shape per length bucket
        h = np.asarray(final_hidden(params, config, jnp.asarray(tokens[idx, :size])))
        for r, n in enumerate(rows):
            k = int(length[n] - plen[n])
            feats[n, :k] = h[r, plen[n] - 1:plen[n] - 1 + k].astype(np.float16)
            done[n] = True
        feats.flush()
        np.save(done_path, done)
    return feats


def features_from_cache(path: str, data_path: str, target_spec: str, arrays: dict) -> np.ndarray:
    """The same [N, R, H] float16 response rows as `extract_features`, read from the heads' feature cache
    (`specjax.train.eagle --features-cache`, or `specjax.train.data --features-out`, which records the features
    while generating) instead of a feature pass of its own. The cache must come from this data file and target."""
    if not os.path.isfile(path):
        raise MedusaTrainError(f"--features-cache {path!r} does not exist; make it with `python -m specjax.train.data "
                               "--features-out` or `python -m specjax.train.eagle --features-only`, or leave it out")
    with np.load(path, allow_pickle=False) as f:
        key = json.loads(str(f["key"]))
        want = json.loads(feature_cache_key(data_path, target_spec, tuple(key.get("layers", ())), 0))
        if key != want:
            diff = {k: (key.get(k), want[k]) for k in want if key.get(k) != want[k]}
            raise MedusaTrainError(f"--features-cache {path} was made from other data or another target {diff} "
                                   "(cache, this run); regenerate it or leave the option out")
        return response_rows(f["final"], arrays)



# ============================================================================================ targets


def build_targets(arrays: dict, rows: np.ndarray, num_heads: int, t2d: np.ndarray) -> dict[str, np.ndarray]:
    """Per feature row (n, i) of `rows`, the targets of heads 1..K, flattened over rows with at least one target.

    t2d [V] int32: draft index of each target id (-1 outside the draft vocabulary).
    Returns row [P] (sequence), pos [P] (feature row i), hard [P, K] int32 (draft index of response token i + k,
    -1 when it is past the response or outside the draft vocabulary), soft_idx [P, K, S] int32 and soft_p [P, K, S]
    float32 (the target's top-S at step i + k renormalised over its in-vocabulary entries; zeros when absent).
    """
    K = num_heads
    R, S = arrays["topk_ids"].shape[1:]
    out = {"row": [], "pos": [], "hard": [], "soft_idx": [], "soft_p": []}
    for n in rows:
        p, k_resp = int(arrays["prompt_len"][n]), int(arrays["length"][n] - arrays["prompt_len"][n])
        m = k_resp - 1  # rows i with i + 1 < k_resp have a target for head 1
        if m <= 0:
            continue
        i = np.arange(m)
        step = i[:, None] + np.arange(1, K + 1)[None, :]  # [m, K] response step each head predicts
        ok = step < k_resp
        stepc = np.minimum(step, R - 1)
        tok = arrays["tokens"][n, p + np.minimum(step, k_resp - 1)]
        hard = np.where(ok, t2d[tok], -1)
        ids = arrays["topk_ids"][n][stepc]  # [m, K, S]
        d = t2d[ids]
        prob = np.exp(arrays["topk_logp"][n][stepc].astype(np.float32)) * (d >= 0) * ok[..., None]
        prob /= np.maximum(prob.sum(-1, keepdims=True), 1e-30)
        out["row"].append(np.full(m, n, np.int32))
        out["pos"].append(i.astype(np.int32))
        out["hard"].append(hard.astype(np.int32))
        out["soft_idx"].append(np.maximum(d, 0).astype(np.int32))
        out["soft_p"].append(prob.astype(np.float32))
    if not out["row"]:
        raise MedusaTrainError("no training positions: every selected sequence has fewer than two response tokens")
    return {k: np.concatenate(v) for k, v in out.items()}


# ============================================================================================ model and loss


def head_losses(blocks, lm: jax.Array, x: jax.Array, batch: dict, hard_weight: float):
    """Per-position, per-head loss [B, K] and top-1 hit [B, K] (argmax == hard target), with mask [B, K].

    x [B, H] features; lm [Vd, H]; batch: hard [B, K], soft_idx/soft_p [B, K, S].
    """
    K = batch["hard"].shape[1]
    logp = jax.nn.log_softmax(head_logits(head_hidden(blocks, x, K), lm), axis=-1)  # [B, K, Vd]
    hard = batch["hard"]
    mask = hard >= 0
    ce_hard = -jnp.take_along_axis(logp, jnp.maximum(hard, 0)[..., None], axis=-1)[..., 0]
    ce_soft = -jnp.sum(batch["soft_p"] * jnp.take_along_axis(logp, batch["soft_idx"], axis=-1), axis=-1)
    has_soft = jnp.sum(batch["soft_p"], axis=-1) > 0
    loss = hard_weight * ce_hard + (1.0 - hard_weight) * jnp.where(has_soft, ce_soft, ce_hard)
    hit = (jnp.argmax(logp, axis=-1) == hard) & mask
    return jnp.where(mask, loss, 0.0), hit, mask


def loss_fn(blocks, lm, x, batch, hard_weight):
    loss, hit, mask = head_losses(blocks, lm, x, batch, hard_weight)
    count = jnp.maximum(jnp.sum(mask, axis=0), 1).astype(jnp.float32)  # [K]
    per_head = jnp.sum(loss, axis=0) / count
    return jnp.mean(per_head), {"loss": jnp.mean(per_head), "head_loss": per_head,
                                "top1": jnp.sum(hit, axis=0) / count}


def update(blocks, opt_state, lm, x, batch, *, optimizer, hard_weight: float):
    """One AdamW step (pure) on the head blocks; the LM head lm [Vd, H] stays frozen. x [B, H] features."""
    return apply_gradients(loss_fn, optimizer, blocks, opt_state, lm, x, batch, hard_weight)


# The same step jitted on its own (blocks and optimizer state donated), for callers outside `fit`.
train_step = jax.jit(update, static_argnames=("optimizer", "hard_weight"), donate_argnums=(0, 1))




@functools.partial(jax.jit, static_argnames=("ranks", "hard_weight"))
def eval_step(blocks, lm, x, batch, *, ranks: int, hard_weight: float):
    """Held-out batch: (loss [B, K], mask [B, K], rank_hit [B, K, ranks]: the r-th best token is the target)."""
    K = batch["hard"].shape[1]
    loss, _, mask = head_losses(blocks, lm, x, batch, hard_weight)
    _, top = jax.lax.top_k(head_logits(head_hidden(blocks, x, K), lm), ranks)  # [B, K, ranks]
    return loss, mask, (top == batch["hard"][..., None]) & mask[..., None]


def evaluate(blocks, lm, feats, targets: dict, batch: int, hard_weight: float, ranks: int = EVAL_RANKS) -> dict:
    """Held-out loss and top-1 per head, rank accuracy acc[k][r] (rank r of head k + 1 is the target's token)
    and the chain acceptance of heads 1..K (all of heads 1..j right: teacher-forced, exact for greedy text)."""
    P = targets["row"].shape[0]
    losses, masks, hits = [], [], []
    for s in range(0, P, batch):
        idx = np.arange(s, s + batch) % P
        x, b = _device_batch(feats, targets, idx)
        loss, mask, hit = eval_step(blocks, lm, x, b, ranks=ranks, hard_weight=hard_weight)
        keep = min(batch, P - s)
        losses.append(np.asarray(loss)[:keep])
        masks.append(np.asarray(mask)[:keep])
        hits.append(np.asarray(hit)[:keep])
    return summarise_eval(np.concatenate(losses), np.concatenate(masks), np.concatenate(hits))


def summarise_eval(loss: np.ndarray, mask: np.ndarray, hit: np.ndarray) -> dict:
    """The held-out record from per-position results: loss [P, K], mask [P, K] (head k has a target), hit
    [P, K, ranks] (rank r of head k is the target's token). See `evaluate`."""
    count = np.maximum(mask.sum(0), 1)
    acc = hit.sum(0) / count[:, None]  # [K, ranks]
    top1 = hit[..., 0]
    # chain: the prefix of heads 1..j all top-1 right, over positions where head j has a target
    run = np.cumprod(top1, axis=1).astype(bool)
    chain = [float(run[mask[:, j], j].mean()) if mask[:, j].any() else float("nan") for j in range(mask.shape[1])]
    return {"loss": float(loss.sum() / mask.sum()), "head_loss": (loss.sum(0) / count).tolist(),
            "top1": acc[:, 0].tolist(), "rank_accuracy": acc.tolist(), "chain_all_right": chain,
            "positions": int(mask[:, 0].sum())}


def _device_batch(feats, targets: dict, idx: np.ndarray):
    rows, pos = targets["row"][idx], targets["pos"][idx]
    order = np.lexsort((pos, rows))  # memory-map reads in file order
    x = np.empty((idx.size, feats.shape[-1]), np.float32)
    x[order] = feats[rows[order], pos[order]]
    return jnp.asarray(x), {k: jnp.asarray(targets[k][idx]) for k in ("hard", "soft_idx", "soft_p")}


# ============================================================================================ corpus
@functools.partial(jax.jit, static_argnames=("num_heads",))
def corpus_head_batch(d: dict, num_heads: int):
    """The heads' batch from `device_targets` output, every position of the [B, T] batch as one row.

    Position p's feature (the target's final hidden state, which predicts token p + 1) gives head k (1..K) the
    token p + 1 + k: the target's greedy token there and its top-S distribution at position p + k, both in the
    draft vocabulary; the row counts only where p and p + k predict response tokens.
    Returns (x [B*T, H] float32, {"hard" [B*T, K] (-1: no target), "soft_idx"/"soft_p" [B*T, K, S]}).
    """
    from specjax.train.corpus import shifted

    final, mask, greedy = d["final"], d["mask"], d["greedy"]
    B, T, H = final.shape
    hard, soft_idx, soft_p = [], [], []
    for k in range(1, num_heads + 1):
        ok = mask & shifted(mask, k, False)
        hard.append(jnp.where(ok, shifted(greedy, k, -1), -1))
        soft_idx.append(shifted(d["soft_idx"], k))
        soft_p.append(shifted(d["soft_p"], k))
    S = d["soft_idx"].shape[-1]
    return final.reshape(B * T, H), {"hard": jnp.stack(hard, -1).reshape(B * T, num_heads),
                                     "soft_idx": jnp.stack(soft_idx, 2).reshape(B * T, num_heads, S),
                                     "soft_p": jnp.stack(soft_p, 2).reshape(B * T, num_heads, S)}


def evaluate_batches(blocks, lm, batches, hard_weight: float, ranks: int = EVAL_RANKS) -> dict | None:
    """`evaluate` over device batches (x, targets) of `corpus_head_batch`; None when no position has a target."""
    losses, masks, hits = [], [], []
    for x, b in batches:
        loss, mask, hit = jax.device_get(eval_step(blocks, lm, x, b, ranks=ranks, hard_weight=hard_weight))
        keep = mask[:, 0]  # head 1 has a target wherever a later head has one
        losses.append(loss[keep])
        masks.append(mask[keep])
        hits.append(hit[keep])
    if not masks or not sum(m.shape[0] for m in masks):
        return None
    return summarise_eval(np.concatenate(losses), np.concatenate(masks), np.concatenate(hits))


# ============================================================================================ run
_RUN_KEYS = ("data", "target", "heads", "layers", "draft_vocab", "batch", "steps", "lr", "warmup", "weight_decay",
             "hard_weight", "seed")


def train(args) -> dict:
    """The run described by the parsed arguments (see `parse_args`). Returns the summary (also in summary.json)."""
    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset, require_dataset

    t_start = time.perf_counter()
    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["data"] = [os.path.abspath(d) for d in args.data] if args.data else None
    # None in a run from before --corpus existed too, so such a run still resumes.
    run["corpus"] = [os.path.abspath(c) for c in args.corpus] if args.corpus else None
    if args.corpus:
        from specjax.train.corpus import shard_hashes

        run.update(corpus_shards=shard_hashes(args.corpus, args.corpus_blocks), corpus_blocks=args.corpus_blocks, max_len=args.max_len, features=args.features)
    for path in () if args.corpus else args.data:
        require_dataset(path)
    check_run(args.out, run, MedusaTrainError)
    if args.corpus:
        return train_on_corpus(args)

    arrays, meta = _load_all(args.data, load_dataset)
    target = load_model(args.target, "float32", with_tokenizer=False)
    tcfg, tparams = target.config, target.params
    V = tcfg.vocab_size
    train_rows = np.flatnonzero(~arrays["heldout"])
    eval_rows = np.flatnonzero(arrays["heldout"])
    if train_rows.size == 0:
        raise MedusaTrainError("no training sequences: every row of the data is held out")

    t0 = time.perf_counter()
    if args.features_cache:
        if len(args.data) != 1:
            raise MedusaTrainError("--features-cache holds the features of one data file; pass one --data file")
        feats = features_from_cache(args.features_cache, args.data[0], args.target, arrays)
    else:
        feats = extract_features(tparams, tcfg, arrays, args.out, batch=args.feature_batch, progress=args.progress)
    feature_seconds = time.perf_counter() - t0

    token_map, t2d = None, np.arange(V, dtype=np.int32)
    if args.draft_vocab:
        token_map = cached_array(os.path.join(args.out, "token_map.npy"), lambda: select_vocab(
            arrays, args.draft_vocab, V, always_ids(meta), rows=train_rows, what="--draft-vocab"))
        t2d = np.full(V, -1, np.int32)
        t2d[token_map] = np.arange(token_map.size, dtype=np.int32)
    hcfg, lm, blocks = _start(args, tcfg, tparams, token_map)
    del tparams, target
    train_t = build_targets(arrays, train_rows, args.heads, t2d)
    eval_t = build_targets(arrays, eval_rows, args.heads, t2d) if eval_rows.size else None
    in_vocab = float(np.mean(train_t["hard"][:, 0] >= 0))

    P = train_t["row"].shape[0]
    per_epoch = max(1, P // args.batch)

    def batch_at(step):
        epoch, k = divmod(step, per_epoch)
        perm = np.random.default_rng([args.seed, epoch]).permutation(P)
        return _device_batch(feats, train_t, perm[k * args.batch:(k + 1) * args.batch])

    def run_eval(p, step, final):
        return None if eval_t is None else evaluate(p, lm, feats, eval_t, args.eval_batch, args.hard_weight)

    res = _fit(args, blocks, lm, batch_at, run_eval)
    summary = {
        "steps": args.steps, "resumed_from_step": res.start, "train_sequences": int(train_rows.size),
        "heldout_sequences": int(eval_rows.size),
        "train_positions": int(P), "draft_vocab": None if token_map is None else int(token_map.size),
        "train_targets_in_draft_vocab": in_vocab, "final_train_loss": train_mean(res.history, "loss"),
        "final_train_head_loss": train_mean(res.history, "head_loss"),
        "final_train_top1": train_mean(res.history, "top1"),
        "feature_seconds_this_run": round(feature_seconds, 1), "train_seconds_this_run": round(res.seconds, 1),
        "total_seconds_this_run": round(time.perf_counter() - t_start, 1),
        "heldout": last_eval(res.history), "data_meta": meta,
    }
    return _export(args, hcfg, res, token_map, summary)


def train_on_corpus(args) -> dict:
    """`train` over token shards (`--corpus`): streamed batches of whole sequences whose features (the target's
    final hidden state, recorded in the corpus or computed online) and soft targets the target gives on device."""
    from specjax.models.loading import load_model
    from specjax.train.corpus import CorpusBatches, SOFT_TOP_K, device_targets, heldout_batches, open_for_target, \
        t2o_table, tokenizer_always_ids, train_vocab

    t_start = time.perf_counter()
    target = load_model(args.target, "float32")
    tcfg, tparams = target.config, target.params
    corpora = open_for_target(args.corpus, target, args.corpus_blocks)
    V = tcfg.vocab_size
    counts_path = os.path.join(args.out, "token_counts.npy")
    token_map = None
    if args.draft_vocab:
        token_map = cached_array(os.path.join(args.out, "token_map.npy"), lambda: train_vocab(
            corpora, args.draft_vocab, V, tokenizer_always_ids(target.tokenizer), counts_path,
            error=MedusaTrainError))
    online = _online(args.features, corpora)
    hcfg, lm, blocks = _start(args, tcfg, tparams, token_map)
    ids = jnp.arange(V, dtype=jnp.int32) if token_map is None else jnp.asarray(token_map)
    t2o = jnp.asarray(t2o_table(V, token_map))
    top_k = min(SOFT_TOP_K, int(ids.shape[0]))
    loader = CorpusBatches(corpora, batch=args.batch, bucket=args.bucket, max_len=args.max_len, seed=args.seed,
                           split="train", features=not online)

    def head_batch(hb: dict):
        d = device_targets(tparams, tcfg, hb, ids, t2o, layers=(), top_k=top_k, online=online)
        return corpus_head_batch(d, num_heads=args.heads)

    tokens_seen = [0]

    def batch_at(step):
        hb = loader.batch_at(step)
        tokens_seen[0] += int(hb["length"].sum())
        return head_batch(hb)

    def run_eval(p, step, final):
        held = heldout_batches(corpora, batch=args.batch, bucket=args.bucket, max_len=args.max_len,
                               limit=args.eval_batches, features=not online)
        return evaluate_batches(p, lm, (head_batch(hb) for hb in held), args.hard_weight)

    res = _fit(args, blocks, lm, batch_at, run_eval)
    secs = res.seconds
    in_vocab = None
    if token_map is not None and os.path.exists(counts_path):
        counts = np.load(counts_path)
        in_vocab = float(counts[token_map].sum() / max(int(counts.sum()), 1))
    summary = {
        "steps": args.steps, "resumed_from_step": res.start, "features": "online" if online else "recorded",
        "corpus": {c.root: c.totals() for c in corpora},
        "draft_vocab": None if token_map is None else int(token_map.size),
        "train_targets_in_draft_vocab": in_vocab, "final_train_loss": train_mean(res.history, "loss"),
        "final_train_head_loss": train_mean(res.history, "head_loss"),
        "final_train_top1": train_mean(res.history, "top1"), "train_seconds_this_run": round(secs, 1),
        "train_tokens_per_s_this_run": round(tokens_seen[0] / secs, 1) if secs > 0 else None,
        "total_seconds_this_run": round(time.perf_counter() - t_start, 1), "heldout": last_eval(res.history),
    }
    return _export(args, hcfg, res, token_map, summary,
                   corpus=[os.path.basename(os.path.normpath(c)) for c in args.corpus])


def _online(mode: str, corpora) -> bool:
    """Whether the target's final hidden state is computed in each step (online) or read from the corpus
    (recorded features start with it): auto reads it when every corpus has its feature files here."""
    from specjax.train.corpus import recorded_features

    if mode == "recorded":
        bad = [c.root for c in corpora if not c.feature_width or (c.manifest.get("features") or [None])[0] != "final"]
        if bad:
            raise MedusaTrainError(f"--features recorded: {', '.join(bad)} holds no recorded final hidden states; "
                                   "use --features online (or auto) or regenerate with --features")
        return False
    return mode == "online" or not (recorded_features(corpora)
                                    and all((c.manifest.get("features") or [None])[0] == "final" for c in corpora))


def _start(args, tcfg, tparams: dict, token_map: np.ndarray | None):
    """(config, frozen LM head rows lm [Vd, H] float32, zero-initialised blocks) of a run."""
    hcfg = MedusaConfig(num_heads=args.heads, hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                        num_layers=args.layers, draft_vocab_size=None if token_map is None else int(token_map.size))
    lm = jnp.array(target_lm_rows(tparams, None if token_map is None else jnp.asarray(token_map)), jnp.float32)
    blocks = init_heads(hcfg, jax.random.PRNGKey(args.seed), jnp.float32, token_map=token_map)["blocks"]
    return hcfg, lm, blocks


def _fit(args, blocks, lm, batch_at, run_eval):
    """The one training loop (`loop.fit`) with this trainer's step, whichever data source feeds it; a batch is
    (features x [P, H], targets)."""
    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)

    def record(m):
        return {"loss": float(m["loss"]), "head_loss": np.asarray(m["head_loss"]).tolist(),
                "top1": np.asarray(m["top1"]).tolist()}

    step = functools.partial(update, optimizer=optimizer, hard_weight=args.hard_weight)
    return fit(lambda b, o, lm_, xb: step(b, o, lm_, *xb), blocks, optimizer, schedule, lm, batch_at, out=args.out,
               steps=args.steps, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, record=record,
               evaluate=run_eval, show=("loss", "top1"), progress=args.progress, desc="train medusa", lr=args.lr,
               describe=lambda ev: f"held-out loss {ev['loss']:.3f} top1 {[round(a, 3) for a in ev['top1']]}",
               params_key="blocks", error=MedusaTrainError, stop_at=args.stop_at)


def _export(args, hcfg: MedusaConfig, res, token_map: np.ndarray | None, summary: dict, **meta) -> dict:
    """The default tree from the final held-out rank accuracy, the heads (OUT/heads or --export, bf16), their
    curves and OUT/summary.json; returns the summary."""
    from specjax.drafters.medusa import choices_from_accuracy, expected_accepted
    from specjax.heads.medusa_io import save_medusa

    final_eval = summary["heldout"]
    choices = choices_from_accuracy(np.asarray(final_eval["rank_accuracy"]), args.tree_nodes) if final_eval else None
    summary["tree_choices"] = [list(c) for c in choices] if choices else None
    summary["tree_expected_accepted"] = expected_accepted(final_eval["rank_accuracy"], choices) if choices else None
    params = {"blocks": res.params}
    if token_map is not None:
        params["token_map"] = jnp.asarray(token_map, jnp.int32)
    export = args.export or os.path.join(args.out, "heads")
    info = {"tree_choices": summary["tree_choices"], "heads_trained_steps": args.steps,
            "heldout_top1": final_eval["top1"] if final_eval else None,
            "heldout_rank_accuracy": final_eval["rank_accuracy"] if final_eval else None, **meta}
    save_medusa(export, hcfg, params, layout="specjax", base_model=args.target, dtype="bfloat16", info=info)
    plot_curves(res.history, os.path.join(export, "training_curve.png"))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _load_all(paths: list[str], load_dataset) -> tuple[dict, dict]:
    """One or more distillation files as one set of arrays (padded to common shapes). Returns (arrays, meta)."""
    loaded = [load_dataset(p) for p in paths]
    if len(loaded) == 1:
        return loaded[0]
    L = max(a["tokens"].shape[1] for a, _ in loaded)
    R = max(a["topk_ids"].shape[1] for a, _ in loaded)
    S = {a["topk_ids"].shape[2] for a, _ in loaded}
    if len(S) != 1:
        raise MedusaTrainError(f"data files keep different top-k sizes {sorted(S)}; regenerate them with one --top-k")

    def pad(x, axis, size):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return np.pad(x, widths)

    out = {}
    for k in loaded[0][0]:
        parts = [a[k] for a, _ in loaded]
        if k == "tokens":
            parts = [pad(p, 1, L) for p in parts]
        elif k in ("topk_ids", "topk_logp"):
            parts = [pad(p, 1, R) for p in parts]
        out[k] = np.concatenate(parts)
    meta = dict(loaded[0][1])
    meta["files"] = [m for _, m in loaded]
    return out, meta


def plot_curves(history: list[dict], path: str) -> None:
    """Loss and top-1 accuracy per head against the step (train smoothed, held-out as markers), to a PNG."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    tr, ev = split_history(history)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    K = len((tr or ev)[0]["top1"]) if (tr or ev) else 0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in range(K):
        c = colors[k % len(colors)]
        for ax, key in ((a1, "head_loss"), (a2, "top1")):
            if tr:
                ax.plot(*smoothed(tr, [r[key][k] for r in tr], 40), color=c, label=f"head {k + 1} train")
            if ev:
                ax.plot([r["step"] for r in ev], [r[key][k] for r in ev], "o--", color=c, alpha=0.7,
                        label=f"head {k + 1} held-out")
    a1.set(xlabel="step", ylabel="cross-entropy", title="loss per head (head k predicts token t + k + 1)")
    a2.set(xlabel="step", ylabel="top-1 accuracy", title="top-1 accuracy per head")
    save_figure(plt, fig, (a1, a2), path, fontsize=7, ncol=2)


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also read by `specjax train-head` to check YAML keys)."""
    ap = argparse.ArgumentParser(prog="python -m specjax.train.medusa",
                                 description="Train Medusa heads on self-distillation data; rerun to resume.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", nargs="+", help="one or more .npz from `python -m specjax.train.data` (in memory)")
    src.add_argument("--corpus", nargs="+", help="token-shard corpus directories from `python -m "
                                                 "specjax.train.generate` (streamed), e.g. OUT/responses")
    add_corpus_blocks_arg(ap)
    ap.add_argument("--features", choices=("auto", "recorded", "online"), default="auto",
                    help="--corpus: the target's final hidden state from the corpus (recorded) or the target's "
                         "forward in each step (online); auto = recorded when every corpus has them")
    ap.add_argument("--max-len", type=int, default=0,
                    help="--corpus: use only the first N tokens of each sequence (0 = all)")
    ap.add_argument("--bucket", type=int, default=64,
                    help="--corpus: sequence lengths are padded to a multiple of this")
    ap.add_argument("--eval-batches", type=int, default=32,
                    help="--corpus: held-out batches (of --batch sequences) per evaluation")
    ap.add_argument("--out", required=True, help="run directory (features, checkpoints, metrics, exported heads)")
    ap.add_argument("--export", default=None, help="where to write the heads (default OUT/heads)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--heads", type=int, default=4, help="K: number of Medusa heads")
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="heads predict this many target ids (0 = all)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=None,
                    help="feature positions per step (--data, default 256) or sequences per step (--corpus, "
                         "default 8; every position of them trains)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--hard-weight", type=float, default=0.5,
                    help="weight of the CE on the emitted token; the rest goes to the target's top-k distribution")
    ap.add_argument("--tree-nodes", type=int, default=15, help="drafted nodes of the exported default tree")
    ap.add_argument("--feature-batch", type=int, default=8)
    ap.add_argument("--features-cache", default=None,
                    help="read the target features from this cache of `specjax.train.data --features-out` (or of "
                         "`specjax.train.eagle`) instead of computing them (one --data file only)")
    add_loop_options(ap, checkpoint_every=100, eval_every=200, eval_batch=1024)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 8 if args.corpus else 256
    if min(args.steps, args.batch, args.heads, args.checkpoint_every, args.eval_every, args.tree_nodes,
           args.bucket, args.eval_batches) < 1:
        ap.error("--steps, --batch, --heads, --checkpoint-every, --eval-every, --tree-nodes, --bucket and "
                 "--eval-batches must be >= 1")
    if args.max_len < 0 or (args.max_len and not args.corpus):
        ap.error("--max-len cuts the sequences of a --corpus (N >= 0); an .npz keeps its own lengths")
    if args.corpus and args.features_cache:
        ap.error("--features-cache serves --data; a --corpus reads recorded features itself (--features recorded)")
    if args.layers < 0 or not 0 <= args.hard_weight <= 1:
        ap.error("--layers must be >= 0 and --hard-weight in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: `python -m specjax.train.medusa --data DATA.npz --out DIR ...`."""
    return report(train(parse_args(argv)))


if __name__ == "__main__":
    main()
