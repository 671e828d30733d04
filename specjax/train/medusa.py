"""Train Medusa heads for a target on its own generations (self-distillation data), in JAX.

Data: `.npz` files from `python -m specjax.train.data` (the target's answers to the project's own prompts, with
its top-k log-probabilities at every response step; never benchmark text). Held-out rows (`heldout`) are only
evaluated.

1. Features. One prefill-style target forward per batch of sequences (`models.llama.forward`, no logits) gives
   the final hidden state at every position; the response rows are cached in OUT/features.npy (float16), a
   memory map filled batch by batch, so an interrupted extraction continues where it stopped.
2. Targets. Feature row i of a sequence is the position that predicts response token i (the target's own LM
   head does that); head k (1..K) learns response token i + k: the hard token the target emitted there and the
   target's top-k distribution at that step (soft), both restricted to the draft vocabulary (`token_map`).
3. Heads (`specjax.heads.medusa`): K heads of residual blocks on the target's tied LM head, restricted to the
   Vd most frequent target tokens of the training data (`--draft-vocab`, 0 = full vocabulary). Only the blocks
   train. Loss per head: hard_weight * CE(hard) + (1 - hard_weight) * CE(soft); their mean over the heads.
4. AdamW with warmup + cosine decay, orbax checkpoints every `--checkpoint-every` steps (rerunning the same
   command resumes), a tqdm bar with the loss and each head's top-1 accuracy, metrics.jsonl, and at the end a
   held-out evaluation (top-k rank accuracy per head, which `drafters.medusa.choices_from_accuracy` turns into
   the default tree), the exported heads (specjax layout, bf16) and a PNG of the training curves.

Run: python -m specjax.train.medusa --data DATA.npz --out DIR [--steps N ...]   (see --help)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.heads.medusa import MedusaConfig, head_hidden, head_logits, init_heads, target_lm_rows
from specjax.kv_cache import init_cache
from specjax.models.llama import LlamaConfig, forward
from specjax.train.common import checkpoint_manager, make_optimizer, pyplot_or_none, read_metrics as _read_metrics
from specjax.errors import SpecjaxError

EVAL_RANKS = 10  # ranks per head measured on held-out data (the default tree uses ranks below this)


class MedusaTrainError(SpecjaxError, ValueError):
    """Medusa training cannot run as asked; the message says how to fix it."""


# ============================================================================================ features


@functools.partial(jax.jit, static_argnames=("config",))
def final_hidden(params: dict, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """The target's final hidden state (after the last norm) at every position: tokens [B, T] -> [B, T, H]."""
    B, T = tokens.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(params, config, tokens, positions, cache, compute_logits=False).hidden


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
    bar = _tqdm(groups, progress, desc="features", unit="batch")
    for size, rows in bar:
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
    from specjax.train.eagle import feature_cache_key

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
        final = f["final"]
    plen, length = arrays["prompt_len"], arrays["length"]
    N, R = arrays["topk_ids"].shape[:2]
    feats = np.zeros((N, R, final.shape[-1]), np.float16)
    for n in range(N):
        k = int(length[n] - plen[n])
        feats[n, :k] = final[n, plen[n] - 1:plen[n] - 1 + k]  # row i = the position predicting response token i
    return feats


# ============================================================================================ targets


def select_token_map(arrays: dict, rows: np.ndarray, size: int, vocab_size: int, always=()) -> np.ndarray:
    """The `size` target ids the heads predict (ascending): ranked by how often they are response tokens or in
    the target's top-k (weighted by probability) in the training rows; `always` (stop ids) are kept."""
    if not len(always) <= size <= vocab_size:
        raise MedusaTrainError(f"--draft-vocab {size} must lie in [{len(always)}, {vocab_size}] (0 = full vocabulary)")
    score = np.zeros(vocab_size, np.float64)
    R = arrays["topk_ids"].shape[1]
    for n in rows:
        p, k = int(arrays["prompt_len"][n]), int(arrays["length"][n] - arrays["prompt_len"][n])
        np.add.at(score, arrays["tokens"][n, p:p + k], 1.0)
        steps = np.arange(R) < k
        np.add.at(score, arrays["topk_ids"][n][steps].ravel(),
                  np.exp(arrays["topk_logp"][n][steps].astype(np.float64)).ravel())
    score[list(always)] = np.inf
    order = np.lexsort((np.arange(vocab_size), -score))  # score descending, then id ascending
    return np.sort(order[:size]).astype(np.int32)


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


@functools.partial(jax.jit, static_argnames=("optimizer", "hard_weight"), donate_argnums=(0, 1))
def train_step(blocks, opt_state, lm, x, batch, *, optimizer, hard_weight: float):
    """One AdamW step on the head blocks (donated with the optimizer state); the LM head stays frozen."""
    import optax

    grads, metrics = jax.grad(loss_fn, has_aux=True)(blocks, lm, x, batch, hard_weight)
    updates, opt_state = optimizer.update(grads, opt_state, blocks)
    return optax.apply_updates(blocks, updates), opt_state, metrics


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
    loss, mask, hit = np.concatenate(losses), np.concatenate(masks), np.concatenate(hits)
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


# ============================================================================================ loop


_RUN_KEYS = ("data", "target", "heads", "layers", "draft_vocab", "batch", "steps", "lr", "warmup", "weight_decay",
             "hard_weight", "seed")


def train(args) -> dict:
    """The run described by the parsed arguments (see `parse_args`). Returns the summary (also in summary.json)."""
    import orbax.checkpoint as ocp

    from specjax.heads.medusa_io import save_medusa
    from specjax.drafters.medusa import choices_from_accuracy, expected_accepted
    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["data"] = [os.path.abspath(d) for d in args.data]
    run_path = os.path.join(args.out, "run.json")
    if os.path.exists(run_path):
        with open(run_path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), run[k]) for k in _RUN_KEYS if old.get(k) != run[k]}
        if diff:
            raise MedusaTrainError(f"{args.out} holds a run with other settings {diff} (old, new); resume with the "
                                   "same arguments or pick a new --out")
    with open(run_path, "w") as f:
        json.dump(run, f, indent=2)

    arrays, meta = _load_all(args.data, load_dataset)
    target = load_model(args.target, "float32", with_tokenizer=False)
    tcfg, tparams = target.config, target.params
    V, H = tcfg.vocab_size, tcfg.hidden_size
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

    map_path = os.path.join(args.out, "token_map.npy")
    if args.draft_vocab:
        if os.path.exists(map_path):
            token_map = np.load(map_path, allow_pickle=False)
        else:
            always = sorted(set(meta.get("stop_token_ids", [])) | {0, 1, 2})
            token_map = select_token_map(arrays, train_rows, args.draft_vocab, V, always)
            np.save(map_path, token_map)
        t2d = np.full(V, -1, np.int32)
        t2d[token_map] = np.arange(token_map.size, dtype=np.int32)
    else:
        token_map, t2d = None, np.arange(V, dtype=np.int32)
    hcfg = MedusaConfig(num_heads=args.heads, hidden_size=H, vocab_size=V, num_layers=args.layers,
                        draft_vocab_size=None if token_map is None else int(token_map.size))
    lm = target_lm_rows(tparams, None if token_map is None else jnp.asarray(token_map))  # [Vd, H] frozen
    lm = jnp.array(lm, jnp.float32)
    del tparams, target
    train_t = build_targets(arrays, train_rows, args.heads, t2d)
    eval_t = build_targets(arrays, eval_rows, args.heads, t2d) if eval_rows.size else None
    in_vocab = float(np.mean(train_t["hard"][:, 0] >= 0))

    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    blocks = init_heads(hcfg, jax.random.PRNGKey(args.seed), jnp.float32,
                        token_map=token_map)["blocks"]
    opt_state = optimizer.init(blocks)
    mngr = checkpoint_manager(args.out, args.checkpoint_every)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"blocks": blocks, "opt": opt_state})
        restored = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        blocks, opt_state = restored["blocks"], restored["opt"]
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    history = _read_metrics(metrics_path, start)

    def log(rec):
        history.append(rec)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    if start == 0 and eval_t is not None and not any(r["kind"] == "eval" for r in history):
        log({"kind": "eval", "step": 0, **evaluate(blocks, lm, feats, eval_t, args.eval_batch, args.hard_weight)})
    P = train_t["row"].shape[0]
    per_epoch = max(1, P // args.batch)
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=start, desc="train medusa", unit="step", disable=not args.progress)
    ema = None
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        # The order is a pure function of (seed, epoch), so a resumed run sees the same batches.
        epoch, k = divmod(step, per_epoch)
        perm = np.random.default_rng([args.seed, epoch]).permutation(P)
        x, b = _device_batch(feats, train_t, perm[k * args.batch:(k + 1) * args.batch])
        blocks, opt_state, m = train_step(blocks, opt_state, lm, x, b, optimizer=optimizer,
                                          hard_weight=args.hard_weight)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            raise MedusaTrainError(f"loss became {loss} at step {step + 1}; lower --lr (now {args.lr})")
        top1 = np.asarray(m["top1"]).tolist()
        ema = (loss, top1) if ema is None else (0.95 * ema[0] + 0.05 * loss,
                                                [0.95 * a + 0.05 * b_ for a, b_ in zip(ema[1], top1)])
        done = step + 1
        log({"kind": "train", "step": done, "loss": loss, "head_loss": np.asarray(m["head_loss"]).tolist(),
             "top1": top1, "lr": float(schedule(step)), "seconds": round(time.perf_counter() - t0, 2)})
        bar.update(1)
        bar.set_postfix(loss=f"{ema[0]:.3f}", top1="/".join(f"{a:.2f}" for a in ema[1]))
        if eval_t is not None and (done % args.eval_every == 0 or done == args.steps):
            ev = evaluate(blocks, lm, feats, eval_t, args.eval_batch, args.hard_weight)
            log({"kind": "eval", "step": done, **ev})
            bar.write(f"step {done}: held-out loss {ev['loss']:.3f} top1 {[round(a, 3) for a in ev['top1']]}")
        mngr.save(done, args=ocp.args.StandardSave({"blocks": blocks, "opt": opt_state}), force=done == args.steps)
    bar.close()
    mngr.wait_until_finished()
    train_seconds = time.perf_counter() - t0

    final_eval = next((r for r in reversed(history) if r["kind"] == "eval"), None)
    choices = None
    if final_eval is not None:
        acc = np.asarray(final_eval["rank_accuracy"])
        choices = choices_from_accuracy(acc, args.tree_nodes)
    params = {"blocks": blocks}
    if token_map is not None:
        params["token_map"] = jnp.asarray(token_map, jnp.int32)
    train_recs = [r for r in history if r["kind"] == "train"]
    last = train_recs[-50:]
    summary = {
        "steps": args.steps, "resumed_from_step": start, "train_sequences": int(train_rows.size),
        "heldout_sequences": int(eval_rows.size),
        "train_positions": int(P), "draft_vocab": None if token_map is None else int(token_map.size),
        "train_targets_in_draft_vocab": in_vocab,
        "final_train_loss": float(np.mean([r["loss"] for r in last])) if last else None,
        "final_train_head_loss": np.mean([r["head_loss"] for r in last], axis=0).tolist() if last else None,
        "final_train_top1": np.mean([r["top1"] for r in last], axis=0).tolist() if last else None,
        "feature_seconds_this_run": round(feature_seconds, 1), "train_seconds_this_run": round(train_seconds, 1),
        "total_seconds_this_run": round(time.perf_counter() - t_start, 1),
        "heldout": final_eval, "tree_choices": [list(c) for c in choices] if choices else None,
        "tree_expected_accepted": expected_accepted(final_eval["rank_accuracy"], choices) if choices else None,
        "data_meta": meta,
    }
    export = args.export or os.path.join(args.out, "heads")
    info = {"tree_choices": summary["tree_choices"], "heads_trained_steps": args.steps,
            "heldout_top1": final_eval["top1"] if final_eval else None,
            "heldout_rank_accuracy": final_eval["rank_accuracy"] if final_eval else None}
    save_medusa(export, hcfg, params, layout="specjax", base_model=args.target, dtype="bfloat16", info=info)
    plot_curves(history, os.path.join(export, "training_curve.png"))
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

    tr = [r for r in history if r["kind"] == "train"]
    ev = [r for r in history if r["kind"] == "eval"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    K = len((tr or ev)[0]["top1"]) if (tr or ev) else 0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if tr:
        steps = np.asarray([r["step"] for r in tr])
        w = max(1, len(tr) // 40)
        smooth = lambda x: np.convolve(x, np.ones(w) / w, mode="valid")
        for k in range(K):
            c = colors[k % len(colors)]
            a1.plot(steps[w - 1:], smooth(np.asarray([r["head_loss"][k] for r in tr])), color=c,
                    label=f"head {k + 1} train")
            a2.plot(steps[w - 1:], smooth(np.asarray([r["top1"][k] for r in tr])), color=c, label=f"head {k + 1} train")
    for k in range(K):
        if ev:
            c = colors[k % len(colors)]
            a1.plot([r["step"] for r in ev], [r["head_loss"][k] for r in ev], "o--", color=c, alpha=0.7,
                    label=f"head {k + 1} held-out")
            a2.plot([r["step"] for r in ev], [r["top1"][k] for r in ev], "o--", color=c, alpha=0.7,
                    label=f"head {k + 1} held-out")
    a1.set(xlabel="step", ylabel="cross-entropy", title="loss per head (head k predicts token t + k + 1)")
    a2.set(xlabel="step", ylabel="top-1 accuracy", title="top-1 accuracy per head")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _tqdm(it, enabled: bool, **kw):
    from tqdm import tqdm

    return tqdm(it, disable=not enabled, **kw)


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also read by `specjax train-head` to check YAML keys)."""
    ap = argparse.ArgumentParser(prog="python -m specjax.train.medusa",
                                 description="Train Medusa heads on self-distillation data; rerun to resume.")
    ap.add_argument("--data", nargs="+", required=True, help="one or more .npz from `python -m specjax.train.data`")
    ap.add_argument("--out", required=True, help="run directory (features, checkpoints, metrics, exported heads)")
    ap.add_argument("--export", default=None, help="where to write the heads (default OUT/heads)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--heads", type=int, default=4, help="K: number of Medusa heads")
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="heads predict this many target ids (0 = all)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=256, help="feature positions per step")
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
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batch", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.heads, args.checkpoint_every, args.eval_every, args.tree_nodes) < 1:
        ap.error("--steps, --batch, --heads, --checkpoint-every, --eval-every and --tree-nodes must be >= 1")
    if args.layers < 0 or not 0 <= args.hard_weight <= 1:
        ap.error("--layers must be >= 0 and --hard-weight in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: `python -m specjax.train.medusa --data DATA.npz --out DIR ...`."""
    summary = train(parse_args(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "data_meta"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
