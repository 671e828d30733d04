"""Distillation data at scale: the target writes its own prompts and answers them, with continuous batching.

    python -m specjax.train.generate --out data/smollm2     # resumable; rerun the same command to continue

Three phases, each a corpus of token shards (`specjax.train.shards`) under OUT:
  instructions  Magpie-style: the chat template up to the user's turn plus a category opener, and the target
                writes the user's message (`specjax.train.magpie`); cleaned and deduplicated into
                OUT/prompts.jsonl together with the project's template prompts (`specjax.train.prompts`).
  responses     every prompt answered greedily, and a share of the training prompts answered again, sampled.
  long          prompts built from earlier answers: summarise or answer questions about a passage the target
                wrote, and a second user turn after the first answer (multi-turn).

The requests run on the serving engine's slot loop (`runners.serving.run_queued`): `batch` slots decode
together, and every `steps` decode steps at most the host takes the finished slots' results and prefills waiting
requests into them. Shapes are fixed per phase, so a phase compiles its programs once. With --features the
target's features (final hidden state and the EAGLE-3 layers, bfloat16) at every position are written next to
each shard, from one teacher-forced forward per group of finished sequences (`features.teacher_forced`).

Requests are grouped in blocks (one shard each); a block's shard is written when all of its requests are done.
Rerunning skips every block the manifest lists, so a crash loses at most the blocks in flight. The plan, the
per-request seeds and the prompt set depend only on --seed and the sizes, so the same command gives the same
corpus.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from specjax.train.common import derived_seed, pad_rows
from specjax.train.shards import (FINISH_LENGTH, FINISH_STOP, CorpusWriter, Sequence_, ShardError, is_heldout,
                                  open_corpus, iter_examples, target_fingerprint, tokenizer_fingerprint)


class Request(NamedTuple):
    id: int  # position in the phase's plan (blocks are id // block_size)
    prompt_id: int
    tokens: np.ndarray  # [P] int32, the chat-formatted prompt
    temperature: float
    max_new: int


class GenShape(NamedTuple):
    """Static shapes of one phase's programs."""

    batch: int  # decoding slots
    prompt_len: int  # prompt bucket (longer prompts are refused by the planner)
    max_new: int  # output bucket (>= every request's max_new)
    steps: int  # decode steps per host check-in at most


def request_seed(seed: int, phase: str, request: int) -> int:
    """A request's sampling seed: a function of the run seed, the phase and the request id only."""
    return derived_seed(seed, sum(map(ord, phase)), request)


# ------------------------------------------------------------------------------------------------- device


# Finished sequences whose features are computed together, in one teacher-forced forward.
FEATURE_BATCH = 8


def generate(llm, requests: Sequence[Request], shape: GenShape, *, seed: int, phase: str,
             on_done: Callable[[Sequence_], None], features: tuple = (), progress=None) -> dict:
    """Run every request through the serving engine's slot loop (`runners.serving.run_queued`, `shape.batch`
    slots); `on_done(seq)` gets each finished one. llm: a `specjax.api.LLM` (or an object with its attributes).

    With `features`, finished sequences are scored in groups of FEATURE_BATCH by one teacher-forced forward
    (`features.teacher_forced`) over prompt + response: the target's features at every position.
    Returns {"sequences", "response_tokens", "seconds"}. progress: an object with update(n) and
    set_postfix(**kw) (a tqdm bar), or None.
    """
    import jax
    import jax.numpy as jnp

    from specjax.config import SamplingParams
    from specjax.runners.serving import run_queued
    from specjax.train.features import teacher_forced

    for r in requests:
        if len(r.tokens) > shape.prompt_len or len(r.tokens) < 1 or r.max_new > shape.max_new:
            raise ShardError(f"request {r.id}: prompt of {len(r.tokens)} tokens / max_new {r.max_new} does not fit "
                             f"the phase's buckets ({shape.prompt_len} / {shape.max_new})")
    if not requests:
        return {"sequences": 0, "response_tokens": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    made = [0]
    waiting: list[tuple[Request, np.ndarray, int]] = []

    def emit(batch: list[tuple[Request, np.ndarray, int]]) -> None:
        feats = [None] * len(batch)
        if features:
            seqs = [np.concatenate([np.asarray(q.tokens, np.int32), resp]) for q, resp, _ in batch]
            tokens = pad_rows(seqs, FEATURE_BATCH)
            f = np.asarray(jax.device_get(teacher_forced(llm.params, llm.config, tokens, tuple(features),
                                                         dtype=jnp.bfloat16)[0]))
            feats = [f[k, :len(t)] for k, t in enumerate(seqs)]
        for (q, resp, finish), f in zip(batch, feats):
            on_done(Sequence_(q.id, q.prompt_id, np.asarray(q.tokens), resp, q.temperature, finish, f))
            made[0] += int(resp.size)
        if progress is not None:
            progress.update(len(batch))
            progress.set_postfix(tok=made[0], tok_s=f"{made[0] / (time.perf_counter() - t0):.0f}")

    def finished(i: int, result) -> None:
        finish = FINISH_STOP if result.finish_reason == "stop" else FINISH_LENGTH
        waiting.append((requests[i], np.asarray(result.token_ids, np.int32), finish))
        if len(waiting) == FEATURE_BATCH or not features:
            emit(waiting[:])
            waiting.clear()

    run_queued(llm, [np.asarray(q.tokens).tolist() for q in requests],
               [SamplingParams(max_new_tokens=q.max_new, temperature=q.temperature,
                               seed=request_seed(seed, phase, q.id)) for q in requests],
               None, shape.batch, step_chunk=shape.steps, on_result=finished,
               share_prefix=True)
    if waiting:
        emit(waiting)
    return {"sequences": len(requests), "response_tokens": made[0], "seconds": time.perf_counter() - t0}


def run_phase(llm, out: str, phase: str, requests: Sequence[Request], shape: GenShape, *, seed: int, header: dict,
              block: int, features: tuple = (), progress: bool = True) -> dict:
    """Generate the blocks of `requests` the corpus OUT/phase does not hold yet. Returns the phase summary."""
    config = llm.config
    feature_width = len(features) * config.hidden_size
    # Slots and steps per check-in do not change the answers (per-request seeds): a resume may change them. refill
    # was a setting of the generator's own loop before it ran on the serving engine; corpora list it.
    writer = CorpusWriter(os.path.join(out, phase), dict(header, phase=phase, shape=shape._asdict(), block=block,
                                                         requests=len(requests), feature_width=feature_width,
                                                         features=list(map(str, features))),
                          run_settings=("batch", "steps", "refill"))
    done_blocks = writer.done_blocks
    todo = [r for r in requests if r.id // block not in done_blocks]
    need: dict[int, int] = {}
    for r in todo:
        need[r.id // block] = need.get(r.id // block, 0) + 1
    pending: dict[int, list[Sequence_]] = {}
    t0, made = time.perf_counter(), [0]
    log_path = os.path.join(out, phase, "runs.jsonl")

    def on_done(seq: Sequence_):
        b = seq.request // block
        pending.setdefault(b, []).append(seq)
        made[0] += seq.response.size
        if len(pending[b]) == need[b]:
            entry = writer.add(b, pending.pop(b), config.vocab_size, feature_width)
            # One line per shard: what this invocation has made so far, so a run stopped before its summary
            # still tells its generation rate.
            with open(log_path, "a") as f:
                f.write(json.dumps({"block": b, "unix_time": round(time.time(), 1), "shard_tokens": entry["tokens"],
                                    "run_seconds": round(time.perf_counter() - t0, 1),
                                    "run_response_tokens": made[0]}) + "\n")

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), initial=len(requests) - len(todo), desc=phase, unit="seq", file=sys.stderr)
    stats = generate(llm, todo, shape, seed=seed, phase=phase, on_done=on_done, features=features, progress=bar)
    if bar is not None:
        bar.close()
    if pending:
        raise ShardError(f"{phase}: blocks {sorted(pending)} did not complete")
    return stats


# ------------------------------------------------------------------------------------------------- plans


def chat_tokens(tokenizer, messages: list[dict]) -> np.ndarray:
    return np.asarray(tokenizer.encode(tokenizer.apply_chat_template(messages)), np.int32)


def instruction_requests(tokenizer, n: int, seed: int, max_new: int, prompt_len: int, temperature: float):
    from specjax.train.magpie import plan_candidates, user_prefix

    prefix = user_prefix(tokenizer)
    cands = plan_candidates(n, seed)
    reqs = []
    for c in cands:
        # The opener's trailing space stays out of the prompt: BPE words carry their leading space, and a prompt
        # ending in a bare space pushes the target to words without one (digits, fragments).
        toks = np.asarray(tokenizer.encode(prefix + c.opener.rstrip()), np.int32)[:prompt_len]
        reqs.append(Request(c.id, c.id, toks, temperature, max_new))
    return cands, reqs


def build_prompt_file(tokenizer, out: str, cands) -> list[dict]:
    """Clean and deduplicate the written instructions, add the template prompts; write OUT/prompts.jsonl."""
    from specjax.train.magpie import clean, dedupe
    from specjax.train.prompts import build_prompts

    corpus = open_corpus(os.path.join(out, "instructions"), check_hashes=False)
    texts = []
    for ex in iter_examples(corpus, split="all", shuffle=False):
        c = cands[ex.prompt_id]
        resp = ex.tokens[ex.prompt_len:]
        if resp.size == 0 or resp[-1] not in tokenizer.stop_token_ids:  # cut off: the message never ended
            continue
        if resp.max() >= tokenizer.vocab_size:  # ids of the model's padded vocabulary that are no text
            continue
        t = clean(c.opener.rstrip() + tokenizer.decode(resp.tolist()))
        if t is not None:
            texts.append((c.id, c.category, t))
    # Template prompts first (ids from 10**6 so they never collide with candidate ids), then the written ones.
    items = [(10 ** 6 + p.index, "template-" + p.category, p.text) for p in build_prompts()] + sorted(texts)
    kept = dedupe(items)
    rows = [{"id": i, "category": cat, "text": t, "heldout": is_heldout(i)} for i, cat, t in kept]
    tmp = os.path.join(out, "prompts.jsonl.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, os.path.join(out, "prompts.jsonl"))
    return rows


def read_prompt_file(out: str) -> list[dict]:
    path = os.path.join(out, "prompts.jsonl")
    if not os.path.isfile(path):
        raise ShardError(f"{path} does not exist; run the instructions phase first")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def response_requests(tokenizer, prompts: list[dict], *, sampled_share: float, temperature: float, max_new: int,
                      prompt_len: int, seed: int) -> list[Request]:
    """Greedy answers to every prompt; a deterministic share of the training prompts also answered sampled."""
    rng = np.random.default_rng([seed, 7])
    extra = rng.random(len(prompts)) < sampled_share
    reqs = []
    for k, p in enumerate(prompts):
        toks = chat_tokens(tokenizer, [{"role": "user", "content": p["text"]}])
        if len(toks) > prompt_len:
            continue
        reqs.append(Request(len(reqs), p["id"], toks, 0.0, max_new))
        if extra[k] and not p["heldout"]:
            reqs.append(Request(len(reqs), p["id"], toks, temperature, max_new))
    return reqs


_SUMMARIZE = ("Summarize the following text in a few sentences.\n\n{p}", "Write a short summary of this passage.\n\n{p}",
              "What are the key points of the text below?\n\n{p}", "TL;DR:\n\n{p}")
_QUESTIONS = ("What is the main idea of the passage?", "Which facts or steps does the passage mention?",
              "Who or what is the passage about, and what does it say about them?",
              "Does the passage give any advice? Quote it.", "What would be a good title for this passage?")
_QA = "Read the passage and answer the question.\n\nPassage:\n{p}\n\nQuestion: {q}"
_FOLLOW_UPS = ("Can you explain that in simpler words?", "Give me a concrete example.",
               "Summarize your answer in two sentences.", "Can you turn that into a short list?",
               "Tell me more about the first point.", "Translate the first sentence of your answer into French.",
               "Why is that?", "Can you make it more formal?")


def _derived_id(base: int, heldout: bool) -> int:
    """The first id from `base` whose held-out status is `heldout`: a prompt made from a held-out answer stays
    held out, so nothing the evaluation reads leaks into training."""
    while is_heldout(base) != heldout:
        base += 1
    return base


def long_requests(tokenizer, out: str, prompts: list[dict], *, source_blocks: int, prompt_len: int, max_new: int,
                  min_passage: int = 60) -> list[Request]:
    """Long-context and multi-turn prompts from the first `source_blocks` shards of the responses phase: summarise
    one answer or three consecutive ones, answer a question about one, or continue the conversation with a
    second user turn. All greedy (they are answered once)."""
    corpus = open_corpus(os.path.join(out, "responses"), check_hashes=False)[0]
    have = {e["block"] for e in corpus.shards}
    if not set(range(source_blocks)) <= have:
        raise ShardError(f"the long phase reads responses blocks 0..{source_blocks - 1}; blocks "
                         f"{sorted(set(range(source_blocks)) - have)[:5]} are not generated yet")
    src = dataclasses.replace(corpus, manifest=dict(corpus.manifest, shards=[e for e in corpus.shards
                                                                             if e["block"] < source_blocks]))
    text_of = {p["id"]: p["text"] for p in prompts}
    answers = [e for e in iter_examples([src], split="all", shuffle=False)
               if e.temperature == 0 and e.tokens.size - e.prompt_len >= min_passage and e.prompt_id in text_of]
    reqs: list[Request] = []
    nid = 2_000_000
    for k, e in enumerate(answers):
        answer = tokenizer.decode(e.tokens[e.prompt_len:].tolist())
        kind = k % 4
        if kind == 0:
            msgs = [{"role": "user", "content": _SUMMARIZE[k // 4 % len(_SUMMARIZE)].format(p=answer)}]
        elif kind == 1:  # a longer context: three consecutive answers as one document
            doc = "\n\n".join(tokenizer.decode(x.tokens[x.prompt_len:].tolist()) for x in answers[k:k + 3])
            msgs = [{"role": "user", "content": _SUMMARIZE[k // 4 % len(_SUMMARIZE)].format(p=doc)}]
        elif kind == 2:
            msgs = [{"role": "user", "content": _QA.format(p=answer, q=_QUESTIONS[k // 4 % len(_QUESTIONS)])}]
        else:
            msgs = [{"role": "user", "content": text_of[e.prompt_id]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": _FOLLOW_UPS[k // 4 % len(_FOLLOW_UPS)]}]
        toks = chat_tokens(tokenizer, msgs)
        if len(toks) > prompt_len:
            continue
        # Derived from a held-out answer (or, for kind 1, containing one): held out too.
        held = any(is_heldout(x.prompt_id) for x in (answers[k:k + 3] if kind == 1 else [e]))
        nid = _derived_id(nid + 1, held)
        reqs.append(Request(len(reqs), nid, toks, 0.0, max_new))
    return reqs


# ------------------------------------------------------------------------------------------------- measuring


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matmul rate in FLOP/s: the median of `repeats` [n, n] x [n, n] products."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / float(np.median(ts))


def compute_limit(params, flops: float) -> dict:
    import jax

    n = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    return {"parameters": n, "matmul_flops": flops, "limit_tokens_per_s": flops / (2 * n)}


# ------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specjax.train.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="corpus directory (rerun with the same settings to resume)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="instructions,responses",
                    help="comma-separated: instructions, responses, long")
    ap.add_argument("--candidates", type=int, default=32000, help="instructions to write (before cleaning)")
    ap.add_argument("--instruction-tokens", type=int, default=64, help="max tokens of a written instruction")
    ap.add_argument("--instruction-temperature", type=float, default=0.8)
    ap.add_argument("--max-new", type=int, default=448, help="max response tokens")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt bucket of the responses phase")
    ap.add_argument("--sampled-share", type=float, default=0.5,
                    help="share of training prompts also answered sampled")
    ap.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled answers")
    ap.add_argument("--long-source-blocks", type=int, default=8,
                    help="long phase: build its prompts from the first N shards of the responses phase")
    ap.add_argument("--long-prompt-len", type=int, default=512)
    ap.add_argument("--long-max-new", type=int, default=256)
    ap.add_argument("--long-batch", type=int, default=96)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block", type=int, default=1024, help="requests per shard")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each phase (for trials)")
    ap.add_argument("--features", action="store_true",
                    help="also record the target's features (final + EAGLE-3 layers, bfloat16) next to each shard")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from specjax.api import LLM
    from specjax.heads.eagle import default_eagle3_layers
    from specjax.models.loading import load_model

    t0 = time.perf_counter()
    m = load_model(args.target, "float32")
    # The fingerprint is of the weights as the file stores them (the engine runs on fused projections).
    header = {"tokenizer": tokenizer_fingerprint(m.tokenizer), "target": target_fingerprint(m.config, m.params),
              "target_spec": args.target, "seed": args.seed, "vocab_size": m.config.vocab_size}
    limit = compute_limit(m.params, matmul_flops())
    del m
    llm = LLM(args.target, "float32", max_num_seqs=None)
    cfg, tok = llm.config, llm.tokenizer
    feats = ("final",) + tuple(default_eagle3_layers(cfg.num_layers)) if args.features else ()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - {"instructions", "responses", "long"})
    if unknown:
        raise SystemExit(f"unknown phases {unknown}; choose from instructions, responses, long")
    summary: dict = {"compute_limit": limit, "phases": {}}
    os.makedirs(args.out, exist_ok=True)
    cut = (lambda r: r[:args.limit]) if args.limit else (lambda r: r)
    if "instructions" in phases:
        P = 64
        cands, reqs = instruction_requests(tok, args.candidates, args.seed, args.instruction_tokens, P,
                                           args.instruction_temperature)
        shape = GenShape(args.batch, P, args.instruction_tokens, args.steps)
        st = run_phase(llm, args.out, "instructions", cut(reqs), shape, seed=args.seed,
                       header=dict(header, candidates=args.candidates, temperature=args.instruction_temperature),
                       block=args.block, progress=args.progress)
        rows = build_prompt_file(tok, args.out, cands)
        summary["phases"]["instructions"] = dict(st, prompts=len(rows),
                                                 heldout_prompts=sum(r["heldout"] for r in rows))
    if "responses" in phases:
        prompts = read_prompt_file(args.out)
        reqs = response_requests(tok, prompts, sampled_share=args.sampled_share, temperature=args.temperature,
                                 max_new=args.max_new, prompt_len=args.prompt_len, seed=args.seed)
        shape = GenShape(args.batch, args.prompt_len, args.max_new, args.steps)
        st = run_phase(llm, args.out, "responses", cut(reqs), shape, seed=args.seed,
                       header=dict(header, prompts=len(prompts), sampled_share=args.sampled_share,
                                   temperature=args.temperature), block=args.block, features=feats,
                       progress=args.progress)
        summary["phases"]["responses"] = st
    if "long" in phases:
        prompts = read_prompt_file(args.out)
        reqs = long_requests(tok, args.out, prompts, source_blocks=args.long_source_blocks,
                             prompt_len=args.long_prompt_len, max_new=args.long_max_new)
        shape = GenShape(args.long_batch, args.long_prompt_len, args.long_max_new, args.steps)
        st = run_phase(llm, args.out, "long", cut(reqs), shape, seed=args.seed,
                       header=dict(header, source_blocks=args.long_source_blocks), block=args.block, features=feats,
                       progress=args.progress)
        summary["phases"]["long"] = st
    for name, st in summary["phases"].items():
        if st["seconds"] > 0 and st["response_tokens"]:
            st["tokens_per_s"] = st["response_tokens"] / st["seconds"]
            st["of_compute_limit"] = st["tokens_per_s"] / limit["limit_tokens_per_s"]
    summary["corpus"] = {p: open_corpus(os.path.join(args.out, p), check_hashes=False)[0].totals()
                         for p in ("instructions", "responses", "long") if os.path.isdir(os.path.join(args.out, p))}
    summary["seconds"] = time.perf_counter() - t0
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
