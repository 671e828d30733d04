"""Self-distillation data: the target answers the project's own prompts, and we keep what it said and thought.

For every prompt the target generates a response with its chat template (greedy, or sampled at a temperature
for a deterministic share of the training prompts). At every response step we also keep the target's top-k
log-probabilities (temperature 1, over the full vocabulary): the decode step computes those logits anyway, so
soft distillation targets cost nothing extra. Step i's top-k is the distribution that produced response token i.

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
state and the EAGLE-3 layers), recorded by the same forward passes, go to the feature cache that
`specjax.train.eagle --features-cache FILE` reads, which then skips its own feature pass over the data.

Run: `python -m specjax.train.data --out /path/to/data.npz` (see --help). Finished batches are kept in
`<out>.partial.npz` as it goes, so rerunning an interrupted command continues instead of starting over.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kv_cache import init_cache
from specjax.sampling import process_logits, sample
from specjax.sampling import top_k as top_k_two_stage
from specjax.models.llama import LlamaConfig, forward
from specjax.train.common import progress_bar
from specjax.train.prompts import Prompt, build_prompts, is_heldout
from specjax.errors import SpecjaxError

FIELDS = ("tokens", "prompt_len", "length", "topk_ids", "topk_logp", "temperature", "prompt_index", "heldout")


class DataError(SpecjaxError, ValueError):
    """A distillation data file is missing, malformed or inconsistent; the message says how to fix it."""


class Generated(NamedTuple):
    """What `generate_batch` returns (B rows, R = max_new_tokens, K = top_k, F = feature width)."""

    tokens: jax.Array  # [B, R] int32, -1 after the row stopped
    topk_ids: jax.Array  # [B, R, K] int32, the target's top-k at each response step, best first
    topk_logp: jax.Array  # [B, R, K] float32, their log-probabilities (full-vocabulary log-softmax, T = 1)
    num_new: jax.Array  # [B] int32, response tokens emitted (the stop token counted)
    prompt_features: jax.Array | None  # [B, P, F] float16 at the prompt positions (valid below prompt_len)
    step_features: jax.Array | None  # [B, R, F] float16 at position prompt_len + i (the i-th response token)


@functools.partial(jax.jit, static_argnames=("config", "max_new", "top_k", "stop_ids", "feature_layers"))
def generate_batch(params: dict, config: LlamaConfig, prompts: jax.Array, prompt_len: jax.Array,
                   temperature: jax.Array, keys: jax.Array, *, max_new: int, top_k: int,
                   stop_ids: tuple[int, ...], feature_layers: tuple[int, ...] | None = None) -> Generated:
    """Generate up to `max_new` tokens for a batch of right-padded prompts and record the target's top-k.

    prompts [B, P] int32, prompt_len [B] int32 (>= 1), temperature [B] float32 (0 = greedy),
    keys [B, 2] uint32 (one PRNG key per row, so a row's sample does not depend on its batch).
    feature_layers: None, or the target layers whose outputs are also recorded at every position, as the
    feature cache of `specjax.train.eagle` holds them: F = H (final normed hidden state) + len(layers) * H.
    The forward passes compute them anyway, which saves the heads' separate feature pass over the data.
    Returns a `Generated`. The loop exits early once every row has emitted a stop token.
    """
    B, P = prompts.shape
    layers = tuple(feature_layers or ())
    want = feature_layers is not None
    cache = init_cache(config.num_layers, B, P + max_new, config.num_kv_heads, config.head_dim,
                       params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))

    def feats(out):  # [B, T, F] float16
        parts = [out.hidden] + ([out.layer_hidden[j] for j in range(len(layers))] if layers else [])
        return jnp.concatenate(parts, axis=-1).astype(jnp.float16)

    out = forward(params, config, prompts, positions, cache, hidden_layers=layers,
                  logit_positions=(prompt_len - 1)[:, None])
    prompt_feats = feats(out) if want else None
    # Padding slots past each prompt were written too, but slots >= lengths are invisible and get overwritten.
    cache = out.cache._replace(lengths=prompt_len.astype(jnp.int32))
    stops = jnp.asarray(stop_ids, jnp.int32)
    F = prompt_feats.shape[-1] if want else 0

    def cond(carry):
        i, _, _, done, *_ = carry
        return (i < max_new) & ~jnp.all(done)

    def body(carry):
        i, cache, logits, done, toks, tk_ids, tk_lp, fbuf = carry
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, V] the target's own distribution (T = 1)
        lp, ix = top_k_two_stage(logp, top_k)
        # specjax's one sampler (`sampling.process_logits` + `sampling.sample`, inverse CDF), on one uniform per
        # row from the row's own key; greedy rows keep the top-1 of the recorded top-k.
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, i)))(keys)
        probs = process_logits(logits, temperature, jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.float32))
        tok = jnp.where(temperature > 0, sample(probs, u), ix[:, 0]).astype(jnp.int32)
        tok = jnp.where(done, -1, tok)
        toks = toks.at[:, i].set(tok)
        tk_ids = tk_ids.at[:, i].set(ix)
        tk_lp = tk_lp.at[:, i].set(lp)
        done = done | jnp.any(tok[:, None] == stops[None, :], axis=-1)
        step = forward(params, config, jnp.maximum(tok, 0)[:, None], cache.lengths[:, None], cache,
                       hidden_layers=layers)
        if want:
            fbuf = fbuf.at[:, i].set(feats(step)[:, 0])
        cache = step.cache._replace(lengths=cache.lengths + 1)
        return i + 1, cache, step.logits[:, 0], done, toks, tk_ids, tk_lp, fbuf

    fbuf = jnp.zeros((B, max_new, F) if want else (0,), jnp.float16)
    init = (jnp.int32(0), cache, out.logits[:, 0], jnp.zeros((B,), bool),
            jnp.full((B, max_new), -1, jnp.int32), jnp.zeros((B, max_new, top_k), jnp.int32),
            jnp.zeros((B, max_new, top_k), jnp.float32), fbuf)
    _, _, _, _, toks, tk_ids, tk_lp, fbuf = jax.lax.while_loop(cond, body, init)
    num = jnp.sum(toks >= 0, axis=1).astype(jnp.int32)
    return Generated(toks, tk_ids, tk_lp, num, prompt_feats, fbuf if want else None)


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


def generate_dataset(params: dict, config: LlamaConfig, tokenizer, prompts: list[Prompt], *, max_new: int = 160,
                     batch: int = 16, top_k: int = 16, sample_every: int = 4, temperature: float = 0.7,
                     extra_samples: int = 0, extra_temperatures: tuple[float, ...] = (1.0, 0.7, 0.4),
                     feature_layers: tuple[int, ...] | None = None, seed: int = 0, progress: bool = True,
                     partial: str | None = None) -> dict[str, np.ndarray]:
    """Run the target on every planned request (`plan_requests`) and return the arrays described in the module
    docstring (meta excluded).

    feature_layers: also return the target features at every position, "features_final" [N, L, H] and
    "features_layers" [N, L, len(layers) * H] float16, zero past each length (the feature cache of
    `specjax.train.eagle`).
    partial: a .npz path where finished batches are saved after each batch (their features next to it, one
    file per batch); an existing one made with the same settings is picked up, so an interrupted run continues
    where it stopped (they are deleted at the end).
    """
    if batch < 1 or max_new < 1 or top_k < 1:
        raise DataError(f"batch ({batch}), max_new ({max_new}) and top_k ({top_k}) must all be >= 1")
    plan = plan_requests(prompts, sample_every, temperature, extra_samples, extra_temperatures)
    ids = [chat_ids(tokenizer, p.text) for p, _, _ in plan]
    P = -(-max(map(len, ids)) // 32) * 32  # the widest prompt: the width of the token array
    # Batches of similar prompt length waste less prefill; the order is deterministic.
    order = sorted(range(len(plan)), key=lambda j: (len(ids[j]), j))
    stop_ids = tuple(sorted(set(tokenizer.stop_token_ids)))
    base = jax.random.key(seed)
    n = len(plan)
    tokens = np.zeros((n, P + max_new), np.int32)
    prompt_len = np.zeros(n, np.int32)
    length = np.zeros(n, np.int32)
    topk_ids = np.zeros((n, max_new, top_k), np.int32)
    topk_logp = np.zeros((n, max_new, top_k), np.float16)
    batches = [order[s:s + batch] for s in range(0, n, batch)]
    done = np.zeros(len(batches), bool)
    settings = np.asarray(json.dumps({"n": n, "P": P, "max_new": max_new, "batch": batch, "top_k": top_k,
                                      "sample_every": sample_every, "temperature": temperature, "seed": seed,
                                      "extra_samples": extra_samples, "extra_temperatures": list(extra_temperatures),
                                      "feature_layers": None if feature_layers is None else list(feature_layers),
                                      "prompts": [len(i) for i in ids]}))
    work = {"tokens": tokens, "prompt_len": prompt_len, "length": length, "topk_ids": topk_ids, "topk_logp": topk_logp}
    if partial and os.path.isfile(partial):
        with np.load(partial, allow_pickle=False) as f:
            if str(f["settings"]) == str(settings):
                done = f["done"].copy()
                for k in work:
                    work[k][...] = f[k]
    H = config.hidden_size
    feat_path = lambda b: f"{partial}.features{b}.npz"
    step_feats: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch -> (prompt [B, P, F], response [B, R, F])
    bar = progress_bar([b for b, d in zip(batches, done) if not d], progress, desc="generate", unit="batch",
                initial=int(done.sum()), total=len(batches))
    made = 0
    t0 = time.perf_counter()
    for rows in bar:
        b = batches.index(rows)
        pad = batch - len(rows)
        rows_p = rows + [rows[-1]] * pad  # pad the last batch by repeating a row (same shape, result dropped)
        # Each batch pads its prompts to its own longest one (rounded up to 64, a handful of compiled shapes):
        # padded to the longest prompt of the whole set, short prompts cost several times their prefill.
        pt = np.zeros((batch, min(-(-max(len(ids[j]) for j in rows_p) // 64) * 64, P)), np.int32)
        for r, j in enumerate(rows_p):
            pt[r, :len(ids[j])] = ids[j]
        plen = np.asarray([len(ids[j]) for j in rows_p], np.int32)
        temps = np.asarray([plan[j][1] for j in rows_p], np.float32)
        keys = np.stack([np.asarray(jax.random.key_data(_answer_key(base, plan[j][0].index, plan[j][2])))
                         for j in rows_p])
        g = jax.device_get(generate_batch(
            params, config, jnp.asarray(pt), jnp.asarray(plen), jnp.asarray(temps), jnp.asarray(keys),
            max_new=max_new, top_k=top_k, stop_ids=stop_ids, feature_layers=feature_layers))
        for r, j in enumerate(rows):
            k = int(g.num_new[r])
            tokens[j, :plen[r]] = pt[r, :plen[r]]
            tokens[j, plen[r]:plen[r] + k] = g.tokens[r, :k]
            prompt_len[j] = plen[r]
            length[j] = plen[r] + k
            topk_ids[j] = g.topk_ids[r]
            topk_logp[j] = g.topk_logp[r].astype(np.float16)
            made += k
        if feature_layers is not None:
            step_feats[b] = (g.prompt_features[:len(rows)], g.step_features[:len(rows)])
        if partial:
            if feature_layers is not None:
                np.savez(feat_path(b), prompt=step_feats[b][0], response=step_feats[b][1])
            done[b] = True
            tmp = partial + ".tmp.npz"
            np.savez(tmp, settings=settings, done=done, **work)
            os.replace(tmp, partial)
        if progress:
            bar.set_postfix(tok=made, tok_s=f"{made / (time.perf_counter() - t0):.1f}")
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
        final = np.zeros((n, L, H), np.float16)
        lay = np.zeros((n, L, len(feature_layers) * H), np.float16)
        for b, rows in enumerate(batches):
            if b not in step_feats:  # made by an earlier, interrupted invocation
                with np.load(feat_path(b), allow_pickle=False) as f:
                    step_feats[b] = (f["prompt"], f["response"])
            fp, fr = step_feats[b]
            for r, j in enumerate(rows):
                pl, ln = int(prompt_len[j]), int(length[j])
                final[j, :pl], lay[j, :pl] = fp[r, :pl, :H], fp[r, :pl, H:]
                final[j, pl:ln], lay[j, pl:ln] = fr[r, :ln - pl, :H], fr[r, :ln - pl, H:]
        out["features_final"], out["features_layers"] = final, lay
    if partial:
        for b in range(len(batches)):
            if os.path.isfile(feat_path(b)):
                os.remove(feat_path(b))
        if os.path.isfile(partial):
            os.remove(partial)
    return out


def _answer_key(base: jax.Array, index: int, answer: int) -> jax.Array:
    """Answer 0 of a prompt keeps the key it always had; answer s > 0 folds s in once more."""
    key = jax.random.fold_in(base, index)
    return jax.random.fold_in(key, answer) if answer else key


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

    from specjax.models.loading import load_model

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    loaded = load_model(args.target, "float32")
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
    arrays = generate_dataset(loaded.params, loaded.config, loaded.tokenizer, prompts,
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
