"""Self-distillation data: the target answers the project's own prompts, and we keep what it said and thought.

For every prompt the target generates a response with its chat template (greedy, or sampled at a temperature
for a deterministic share of the training prompts), on the serving engine's slot loop. At every response step we
also keep the target's top-k log-probabilities (temperature 1, over the full vocabulary), from one teacher-forced
forward over each finished block of sequences: step i's top-k is the distribution that produced response token i.

Everything is saved to one `.npz` of plain arrays (no pickles; `np.load(..., allow_pickle=False)` reads it):
    tokens       [N, L] int32    prompt followed by response, zero-padded
    prompt_len   [N] int32       tokens of the chat-formatted prompt
    length       [N] int32       prompt_len + number of response tokens (the stop token included)
    topk_ids     [N, R, K] int32 target top-k token ids at response step i (R = max_new_tokens)
    topk_logp    [N, R, K] float16 their log-probabilities (log-softmax over the full vocabulary)
    temperature  [N] float32     0 = greedy
    prompt_index [N] int32       index in `specjax.train.prompts.build_prompts()`
    heldout      [N] bool        evaluation split (never trained on)
    meta         0-d str         JSON: target, max_new_tokens, top_k, seed, generation seconds, ...

Rows: one per planned answer (`plan_requests`): every prompt once, and with `--extra-samples n` every training
prompt n more times, sampled. With `--features-out FILE` the target features at every position (final hidden
state and the EAGLE-3 layers), from the same teacher-forced forward, go to the feature cache that
`specjax.train.eagle --features-cache FILE` reads, which then skips its own feature pass over the data.

Run: `python -m specjax.train.data --out /path/to/data.npz` (see --help). Finished blocks are kept in
`<out>.partial.npz` as it goes, so rerunning an interrupted command continues instead of starting over.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train.common import derived_seed, pad_rows, progress_bar
from specjax.train.features import teacher_forced
from specjax.train.prompts import Prompt, build_prompts, is_heldout
from specjax.errors import SpecjaxError

FIELDS = ("tokens", "prompt_len", "length", "topk_ids", "topk_logp", "temperature", "prompt_index", "heldout")


class DataError(SpecjaxError, ValueError):
    """A distillation data file is missing, malformed or inconsistent; the message says how to fix it."""


def chat_ids(tokenizer, text: str) -> list[int]:
    """The token ids the target sees for a one-turn chat (same as `LLM.generate(..., chat=True)`)."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def plan_requests(prompts: list[Prompt], sample_every: int, temperature: float, extra_samples: int = 0,
                  extra_temperatures: tuple[float, ...] = (1.0, 0.7, 0.4)) -> list[tuple[Prompt, float, int]]:
    """Which prompts are answered greedily and which are sampled, as (prompt, temperature, answer number).

    Held-out prompts are answered once, greedily (the greedy-acceptance evaluation needs the target's greedy
    continuation); every `sample_every`-th training prompt is sampled at `temperature` (0 = never). With
    `extra_samples` = n, every training prompt gets n more sampled answers, at temperatures cycling through
    `extra_temperatures`: more of the target's own text per prompt, more varied than its greedy answer."""
    if extra_samples < 0:
        raise DataError(f"extra_samples must be >= 0, got {extra_samples}")
    if extra_samples and (not extra_temperatures or min(extra_temperatures) <= 0):
        raise DataError(f"extra answers are sampled: extra_temperatures must all be > 0, got {extra_temperatures}")
    plan = []
    for p in prompts:
        sampled = sample_every > 0 and not is_heldout(p.index) and p.index % sample_every == 1
        plan.append((p, temperature if sampled else 0.0, 0))
    for s in range(1, extra_samples + 1):
        for p in prompts:
            if not is_heldout(p.index):
                plan.append((p, float(extra_temperatures[(s - 1) % len(extra_temperatures)]), s))
    return plan


def generate_dataset(llm, prompts: list[Prompt], *, max_new: int = 160, batch: int = 16, top_k: int = 16,
                     sample_every: int = 4, temperature: float = 0.7, extra_samples: int = 0,
                     extra_temperatures: tuple[float, ...] = (1.0, 0.7, 0.4),
                     feature_layers: tuple[int, ...] | None = None, seed: int = 0, progress: bool = True,
                     partial: str | None = None) -> dict[str, np.ndarray]:
    """Run the target on every planned request (`plan_requests`) and return the arrays described in the module
    docstring (meta excluded). llm: a `specjax.api.LLM` (or an object with its attributes).

    The answers come from the serving engine's slot loop (`runners.serving.run_queued`, `batch` slots); rows are
    grouped in blocks of `batch` (by prompt length), and a block's answers are scored together once all of them
    are done: one teacher-forced forward (`features.teacher_forced`) gives the top-k at every response step and,
    with feature_layers, the target features at every position, "features_final" [N, L, H] and
    "features_layers" [N, L, len(layers) * H] float16, zero past each length (the feature cache of
    `specjax.train.eagle`).
    partial: a .npz path where finished blocks are saved as they complete (their features next to it, one
    file per block); an existing one made with the same settings is picked up, so an interrupted run continues
    where it stopped (they are deleted at the end).
    """
    from specjax.config import SamplingParams
    from specjax.runners.serving import run_queued

    if batch < 1 or max_new < 1 or top_k < 1:
        raise DataError(f"batch ({batch}), max_new ({max_new}) and top_k ({top_k}) must all be >= 1")
    config, tokenizer = llm.config, llm.tokenizer
    plan = plan_requests(prompts, sample_every, temperature, extra_samples, extra_temperatures)
    ids = [chat_ids(tokenizer, p.text) for p, _, _ in plan]
    P = -(-max(map(len, ids)) // 32) * 32  # the widest prompt: the width of the token array
    # Blocks of similar prompt length pad less in the scoring forward; the order is deterministic.
    order = sorted(range(len(plan)), key=lambda j: (len(ids[j]), j))
    n = len(plan)
    tokens = np.zeros((n, P + max_new), np.int32)
    prompt_len = np.zeros(n, np.int32)
    length = np.zeros(n, np.int32)
    topk_ids = np.zeros((n, max_new, top_k), np.int32)
    topk_logp = np.zeros((n, max_new, top_k), np.float16)
    blocks = [order[s:s + batch] for s in range(0, n, batch)]
    done = np.zeros(len(blocks), bool)
    settings = np.asarray(json.dumps({"n": n, "P": P, "max_new": max_new, "batch": batch, "top_k": top_k,
                                      "sample_every": sample_every, "temperature": temperature, "seed": seed,
                                      "extra_samples": extra_samples, "extra_temperatures": list(extra_temperatures),
                                      "feature_layers": None if feature_layers is None else list(feature_layers),
                                      "prompts": [len(i) for i in ids], "scored": "teacher-forced"}))
    work = {"tokens": tokens, "prompt_len": prompt_len, "length": length, "topk_ids": topk_ids, "topk_logp": topk_logp}
    if partial and os.path.isfile(partial):
        with np.load(partial, allow_pickle=False) as f:
            if str(f["settings"]) == str(settings):
                done = f["done"].copy()
                for k in work:
                    work[k][...] = f[k]
    feats_spec = () if feature_layers is None else ("final",) + tuple(feature_layers)
    feat_path = lambda b: f"{partial}.features{b}.npz"
    block_feats: dict[int, np.ndarray] = {}  # block -> [batch, T, F] float16
    block_of = {j: b for b, rows in enumerate(blocks) for j in rows}
    left = {b: len(rows) for b, rows in enumerate(blocks) if not done[b]}
    todo = [j for b, rows in enumerate(blocks) if not done[b] for j in rows]
    bar = progress_bar(None, progress, desc="generate", unit="block", initial=int(done.sum()), total=len(blocks))
    made = [0]
    t0 = time.perf_counter()

    def score(b: int) -> None:
        f = score_block(llm, work, blocks[b], batch, feats_spec)
        if f is not None:
            block_feats[b] = f
        if partial:
            if f is not None:
                np.savez(feat_path(b), features=f)
            done[b] = True
            tmp = partial + ".tmp.npz"
            np.savez(tmp, settings=settings, done=done, **work)
            os.replace(tmp, partial)
        if progress:
            bar.update(1)
            bar.set_postfix(tok=made[0], tok_s=f"{made[0] / (time.perf_counter() - t0):.1f}")

    def finished(i: int, result) -> None:
        j = todo[i]
        out = np.asarray(result.token_ids, np.int32)
        pl = len(ids[j])
        tokens[j, :pl], tokens[j, pl:pl + out.size] = ids[j], out
        prompt_len[j], length[j] = pl, pl + out.size
        made[0] += int(out.size)
        b = block_of[j]
        left[b] -= 1
        if not left[b]:
            score(b)

    if todo:
        samplings = [SamplingParams(max_new_tokens=max_new, temperature=plan[j][1],
                                    seed=answer_seed(seed, plan[j][0].index, plan[j][2])) for j in todo]
        run_queued(llm, [ids[j] for j in todo], samplings, None, batch, step_chunk=16, on_result=finished,
                   share_prefix=True)
    if progress:
        bar.close()
    L = min(-(-int(length.max()) // 32) * 32, tokens.shape[1])
    out = {
        "tokens": tokens[:, :L],
        "prompt_len": prompt_len,
        "length": length,
        "topk_ids": topk_ids,
        "topk_logp": topk_logp,
        "temperature": np.asarray([t for _, t, _ in plan], np.float32),
        "prompt_index": np.asarray([p.index for p, _, _ in plan], np.int32),
        "heldout": np.asarray([is_heldout(p.index) for p, _, _ in plan], bool),
    }
    if feature_layers is not None:
        for b in range(len(blocks)):
            if b not in block_feats:  # made by an earlier, interrupted invocation
                with np.load(feat_path(b), allow_pickle=False) as f:
                    block_feats[b] = f["features"]
        out["features_final"], out["features_layers"] = spread_features(block_feats, blocks, length, L,
                                                                         config.hidden_size)
    if partial:
        for b in range(len(blocks)):
            if os.path.isfile(feat_path(b)):
                os.remove(feat_path(b))
        if os.path.isfile(partial):
            os.remove(partial)
    return out


def score_block(llm, work: dict[str, np.ndarray], rows: list[int], batch: int, features: tuple) -> np.ndarray | None:
    """Score the finished rows `rows` of `work` (the module's arrays) in one teacher-forced forward padded to
    `batch` rows: their top-k at every response step is written into work["topk_ids"] / work["topk_logp"] (zero
    past each response). Returns the target `features` at every position [len(rows), T, F] float16, or None."""
    tokens, prompt_len, length = work["tokens"], work["prompt_len"], work["length"]
    max_new, top_k = work["topk_ids"].shape[1:]
    seq = pad_rows([tokens[j, :length[j]] for j in rows], batch, width=tokens.shape[1])
    at = np.zeros((batch, max_new), np.int32)
    for r, j in enumerate(rows):
        # Response step i is predicted at position prompt_len - 1 + i (past the end: the last position).
        at[r] = np.minimum(prompt_len[j] - 1 + np.arange(max_new), max(length[j] - 1, 0))
    f, (lp, ix) = jax.device_get(teacher_forced(llm.params, llm.config, seq, features, at, top_k, jnp.float16))
    for r, j in enumerate(rows):
        k = int(length[j] - prompt_len[j])
        work["topk_ids"][j, :k], work["topk_logp"][j, :k] = ix[r, :k], lp[r, :k].astype(np.float16)
    if not features:
        return None
    if not np.isfinite(f[:len(rows)]).all():
        raise DataError("target features overflow float16; this target's activations are too large for the "
                        "feature cache")
    return f[:len(rows)]


def spread_features(block_feats: dict[int, np.ndarray], blocks: list[list[int]], length: np.ndarray, L: int,
                    H: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block features [rows, T, H + layers * H] -> ("features_final" [N, L, H], "features_layers"
    [N, L, layers * H]) float16 in row order, zero past each length."""
    F = next(iter(block_feats.values())).shape[-1]
    final = np.zeros((len(length), L, H), np.float16)
    lay = np.zeros((len(length), L, F - H), np.float16)
    for b, rows in enumerate(blocks):
        fb = block_feats[b]
        for r, j in enumerate(rows):
            ln = min(int(length[j]), fb.shape[1], L)
            final[j, :ln], lay[j, :ln] = fb[r, :ln, :H], fb[r, :ln, H:]
    return final, lay


def answer_seed(seed: int, index: int, answer: int) -> int:
    """The sampling seed of answer `answer` to prompt `index`: a function of the run seed and those two only."""
    return derived_seed(seed, index, answer)


def save_dataset(path: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    missing = [f for f in FIELDS if f not in arrays]
    if missing:
        raise DataError(f"cannot save distillation data: arrays {missing} are missing")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **{f: arrays[f] for f in FIELDS}, meta=np.asarray(json.dumps(meta, sort_keys=True)))


def require_dataset(path: str) -> None:
    """Raise DataError naming the command that makes `path` when it is not a file. Trainers call it before they
    create their output folder, so a run without its data leaves nothing behind."""
    if not os.path.isfile(path):
        raise DataError(f"distillation data {path!r} does not exist; make it with `python -m specjax.train.data --out {path}`")


def load_dataset(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """Read and check a file written by `save_dataset`. Returns (arrays, meta)."""
    require_dataset(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable .npz without pickles ({e}); regenerate it") from None
    missing = [k for k in FIELDS + ("meta",) if k not in arrays]
    if missing:
        raise DataError(f"{path}: arrays {missing} are missing; regenerate it with `python -m specjax.train.data`")
    meta = json.loads(str(arrays.pop("meta")))
    n, L = arrays["tokens"].shape
    R = arrays["topk_ids"].shape[1]
    if arrays["topk_logp"].shape != arrays["topk_ids"].shape or arrays["topk_ids"].shape[0] != n:
        raise DataError(f"{path}: topk_ids {arrays['topk_ids'].shape} and topk_logp {arrays['topk_logp'].shape} "
                        f"must both be [N={n}, R, K]")
    if np.any(arrays["length"] > L) or np.any(arrays["length"] - arrays["prompt_len"] > R) \
            or np.any(arrays["prompt_len"] < 1):
        raise DataError(f"{path}: lengths are inconsistent with tokens [N, {L}] and {R} response steps; regenerate it")
    return arrays, meta


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specjax.train.data",
                                 description="Generate self-distillation data from the target model.")
    ap.add_argument("--out", required=True, help="output .npz path")
    ap.add_argument("--target", default="smollm2-135m", help="target model spec (alias, HF dir or .gguf)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=16, help="target log-probs kept per step for soft distillation")
    ap.add_argument("--sample-every", type=int, default=4,
                    help="every N-th training prompt is sampled instead of greedy (0 = all greedy)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--extra-samples", type=int, default=0,
                    help="sampled answers per training prompt on top of the first one (held-out prompts: none)")
    ap.add_argument("--extra-temperatures", default="1.0,0.7,0.4",
                    help="temperatures the extra answers cycle through (comma-separated, each > 0)")
    ap.add_argument("--features-out", default=None,
                    help="also write the target feature cache that `specjax.train.eagle --features-cache` reads, "
                         "recorded during generation (saves the heads' separate feature pass)")
    ap.add_argument("--feature-layers", default=None,
                    help="layers recorded for EAGLE-3 with --features-out (default: the heads' default low/mid/high)")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from specjax.api import LLM

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    loaded = LLM(args.target, "float32", max_num_seqs=None)
    prompts = build_prompts()
    if args.limit:
        prompts = prompts[:args.limit]
    try:
        extra_t = tuple(float(t) for t in args.extra_temperatures.split(","))
    except ValueError:
        ap.error(f"--extra-temperatures: expected comma-separated numbers, got {args.extra_temperatures!r}")
    layers = None
    if args.features_out:
        from specjax.heads.eagle import default_eagle3_layers

        layers = (tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers
                  else tuple(default_eagle3_layers(loaded.config.num_layers)))
        bad = [x for x in layers if not -loaded.config.num_layers <= x < loaded.config.num_layers]
        if bad:
            ap.error(f"--feature-layers {bad} out of range for a {loaded.config.num_layers}-layer target")
    t0 = time.perf_counter()
    arrays = generate_dataset(loaded, prompts,
                              max_new=args.max_new_tokens, batch=args.batch, top_k=args.top_k,
                              sample_every=args.sample_every, temperature=args.temperature,
                              extra_samples=args.extra_samples, extra_temperatures=extra_t, feature_layers=layers,
                              seed=args.seed, partial=args.out + ".partial.npz")
    seconds = time.perf_counter() - t0  # of this invocation (a resumed run counts only its own part)
    new_tokens = int(np.sum(arrays["length"] - arrays["prompt_len"]))
    meta = {"target": args.target, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
            "sample_every": args.sample_every, "temperature": args.temperature, "seed": args.seed,
            "extra_samples": args.extra_samples, "extra_temperatures": list(extra_t),
            "num_prompts": len(prompts), "num_sequences": int(arrays["length"].size), "response_tokens": new_tokens,
            "generation_seconds": round(seconds, 1), "stop_token_ids": list(loaded.tokenizer.stop_token_ids)}
    save_dataset(args.out, arrays, meta)
    if args.features_out:
        from specjax.train.features import feature_cache_key, save_feature_cache

        save_feature_cache(args.features_out, feature_cache_key(args.out, args.target, layers),
                           {"final": arrays["features_final"], "layers": arrays["features_layers"]})
    print(json.dumps(meta))
    return meta


if __name__ == "__main__":
    main()
