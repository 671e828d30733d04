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

Run: python -m specjax.train.medusa --data DATA.npz --out DIR [--steps N ...]   (see --help)
"""
from __future__ import annotations
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


# ============================================================================================ run
_RUN_KEYS = ("data", "target", "heads", "layers", "draft_vocab", "batch", "steps", "lr", "warmup", "weight_decay",
             "hard_weight", "seed")


def train(args) -> dict:
    """The run described by the parsed arguments (see `parse_args`). Returns the summary (also in summary.json)."""
    from specjax.drafters.medusa import choices_from_accuracy, expected_accepted
    from specjax.heads.medusa_io import save_medusa
    from specjax.models.loading import load_model
    from specjax.train.data import load_dataset

    t_start = time.perf_counter()
    run = {k: getattr(args, k) for k in _RUN_KEYS}
    run["data"] = [os.path.abspath(d) for d in args.data]
    check_run(args.out, run, MedusaTrainError)

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

    token_map, t2d = None, np.arange(V, dtype=np.int32)
    if args.draft_vocab:
        token_map = cached_array(os.path.join(args.out, "token_map.npy"), lambda: select_vocab(
            arrays, args.draft_vocab, V, always_ids(meta), rows=train_rows, what="--draft-vocab"))
        t2d = np.full(V, -1, np.int32)
        t2d[token_map] = np.arange(token_map.size, dtype=np.int32)
    hcfg = MedusaConfig(num_heads=args.heads, hidden_size=H, vocab_size=V, num_layers=args.layers,
                        draft_vocab_size=None if token_map is None else int(token_map.size))
    lm = target_lm_rows(tparams, None if token_map is None else jnp.asarray(token_map))  # [Vd, H] frozen
    lm = jnp.array(lm, jnp.float32)
    del tparams, target
    train_t = build_targets(arrays, train_rows, args.heads, t2d)
    eval_t = build_targets(arrays, eval_rows, args.heads, t2d) if eval_rows.size else None
    in_vocab = float(np.mean(train_t["hard"][:, 0] >= 0))

    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    blocks = init_heads(hcfg, jax.random.PRNGKey(args.seed), jnp.float32, token_map=token_map)["blocks"]
    P = train_t["row"].shape[0]
    per_epoch = max(1, P // args.batch)

    def batch_at(step):
        epoch, k = divmod(step, per_epoch)
        perm = np.random.default_rng([args.seed, epoch]).permutation(P)
        return _device_batch(feats, train_t, perm[k * args.batch:(k + 1) * args.batch])

    def run_eval(p, step, final):
        return None if eval_t is None else evaluate(p, lm, feats, eval_t, args.eval_batch, args.hard_weight)

    def record(m):
        return {"loss": float(m["loss"]), "head_loss": np.asarray(m["head_loss"]).tolist(),
                "top1": np.asarray(m["top1"]).tolist()}

    step = functools.partial(update, optimizer=optimizer, hard_weight=args.hard_weight)
    res = fit(lambda b, o, lm_, xb: step(b, o, lm_, *xb), blocks, optimizer, schedule, lm, batch_at, out=args.out,
              steps=args.steps, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, record=record,
              evaluate=run_eval, show=("loss", "top1"), progress=args.progress, desc="train medusa", lr=args.lr,
              describe=lambda ev: f"held-out loss {ev['loss']:.3f} top1 {[round(a, 3) for a in ev['top1']]}",
              params_key="blocks", error=MedusaTrainError)

    final_eval = last_eval(res.history)
    choices = choices_from_accuracy(np.asarray(final_eval["rank_accuracy"]), args.tree_nodes) if final_eval else None
    params = {"blocks": res.params}
    if token_map is not None:
        params["token_map"] = jnp.asarray(token_map, jnp.int32)
    summary = {
        "steps": args.steps, "resumed_from_step": res.start, "train_sequences": int(train_rows.size),
        "heldout_sequences": int(eval_rows.size),
        "train_positions": int(P), "draft_vocab": None if token_map is None else int(token_map.size),
        "train_targets_in_draft_vocab": in_vocab, "final_train_loss": train_mean(res.history, "loss"),
        "final_train_head_loss": train_mean(res.history, "head_loss"),
        "final_train_top1": train_mean(res.history, "top1"),
        "feature_seconds_this_run": round(feature_seconds, 1), "train_seconds_this_run": round(res.seconds, 1),
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
    add_loop_options(ap, checkpoint_every=100, eval_every=200, eval_batch=1024)
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
    return report(train(parse_args(argv)))


if __name__ == "__main__":
    main()
