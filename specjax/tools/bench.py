"""Benchmark harness: run a prompt set through plain decoding and speculative methods, measure everything the
field compares on, per category and overall.

Datasets: Spec-Bench format (JSONL with question_id, category, turns), a JSONL of {"prompt": ...} or
{"messages": [...]}, or a plain text file with one prompt per line. Any file in these formats works; nothing is
read from a fixed location.

Timing excludes compilation: the first request of every new shape bucket is run once untimed. Batch 1 by
default (the latency setting of the papers). Figures per method and category: tokens/s, speedup over plain (ratio
of tokens/s on the same prompts), acceptance rate alpha, mean accepted length tau (1 + accepted / verify steps, as
in the papers and vLLM), tokens per target forward (plain backed-off steps counted: what bounds the speedup),
per-position acceptance, TTFT and end-to-end latency p50/p90.

Optional extras: a throughput run at larger batch sizes (`run_throughput`: tokens/s against batch size, with a
check that greedy outputs equal the batch-1 ones) and a profiled pass (`run_profile`: draft against verify time,
through the host-stepped loop of `speculative.generate(..., profile=True)`). Configurations with lossy acceptance
(`SpeculativeConfig.is_lossy`) carry LOSSY in their label everywhere.

This module measures and summarises; the tables, Markdown and plots are `specjax.tools.report`, the command
line `specjax.cli.bench`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from specjax.config import ConfigError, SamplingParams, SpeculativeConfig, load_run_config, to_dict
from specjax.errors import SpecjaxError

LOSSY_TAG = "LOSSY"  # appended to the label of every configuration whose acceptance is not exact


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    turns: tuple[str, ...]


class DatasetError(SpecjaxError, ValueError):
    """A dataset file could not be read; the message names the file and line."""


def load_prompts(path: str, *, per_category: int | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Read a Spec-Bench / prompt JSONL / text file; optionally keep the first `per_category` of each category."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset {path!r} does not exist")
    out: list[BenchPrompt] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    is_jsonl = path.endswith((".jsonl", ".json"))
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not is_jsonl:
            out.append(BenchPrompt(str(n), "text", (line,)))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if "turns" in obj:
            turns = tuple(obj["turns"])
        elif "prompt" in obj:
            turns = (obj["prompt"],)
        elif "messages" in obj:
            turns = tuple(m["content"] for m in obj["messages"] if m.get("role") == "user")
        else:
            raise DatasetError(f"{path}:{n}: unknown format: expected 'turns' (Spec-Bench), 'prompt' or 'messages'")
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise DatasetError(f"{path}:{n}: empty or non-text turns")
        out.append(BenchPrompt(str(obj.get("question_id", obj.get("id", n))), str(obj.get("category", "all")), turns))
    if per_category is not None:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in out:
            if seen[p.category] < per_category:
                kept.append(p)
                seen[p.category] += 1
        out = kept
    return out[:limit] if limit else out


def method_from_name(name: str) -> tuple[str, SpeculativeConfig | None]:
    """'plain', a packaged config ('methods/ngram') or a YAML path -> (label, SpeculativeConfig or None)."""
    if name in ("plain", "none", "methods/plain"):
        return "plain", None
    try:
        cfg = load_run_config(name if "/" in name or name.endswith(".yaml") else f"methods/{name}")
    except ConfigError as e:
        raise ConfigError(f"benchmark method {name!r}: {e}") from None
    spec = cfg.speculative
    if not spec.enabled:
        return "plain", None
    return method_label(spec), spec


def method_label(spec: SpeculativeConfig) -> str:
    """'ngram(k=4)', 'eagle3(tree 4x4, 12 nodes)', 'eagle3(chain 4)', 'medusa(15 nodes)', with '+lookup 4' when a
    lookup branch is merged in; lossy configurations get ' LOSSY' so no table can pass them off as exact."""
    if spec.method in ("eagle", "eagle3"):
        shape = (f"chain {spec.depth}" if spec.top_k == 1
                 else f"tree {spec.top_k}x{spec.depth}, {spec.total_tokens} nodes")
        label = f"{spec.method}({shape})"
    elif spec.method == "medusa" and spec.tree_choices is not None:
        chain = all(set(c) == {0} for c in spec.tree_choices)
        n = len(spec.tree_choices)
        label = f"medusa(chain {n})" if chain else f"medusa({n} nodes)"
    else:
        label = f"{spec.method}(k={spec.num_speculative_tokens})"
    if spec.lookup_tokens:
        label = f"{label[:-1]}, +lookup {spec.lookup_tokens})"
    return f"{label} {LOSSY_TAG}" if spec.is_lossy else label


def method_info(name: str, spec: SpeculativeConfig | None) -> dict:
    """What the JSON records about one method: the name asked for, lossy or not, the full config."""
    return {"name": name, "lossy": bool(spec is not None and spec.is_lossy),
            "config": to_dict(spec) if spec is not None else None}


def _fastest(call, reps: int, llm=None):
    """(seconds, result) of the fastest of `reps` runs of call() (greedy and seeded sampling repeat exactly, so
    only the time differs): on a shared machine the fastest run is the least disturbed one. With `llm`, what a
    generation teaches the next (suffix index, back-off priors; `speculative.learned_state`) is reset before every
    repetition, so each one starts where the first did instead of replaying its own answer."""
    from specjax.runners.speculative import learned_state, restore_learned

    saved = learned_state(llm) if llm is not None and reps > 1 else None
    best = None
    for i in range(max(reps, 1)):
        if i and saved is not None:
            restore_learned(llm, saved)
        t0 = time.perf_counter()
        out = call()
        t = time.perf_counter() - t0
        if best is None or t < best[0]:
            best = (t, out)
    return best


def run_requests(llm, prompts: Sequence[BenchPrompt], spec: SpeculativeConfig | None, sampling: SamplingParams,
                 all_turns: bool = False, progress=None, reps: int = 1) -> list[dict]:
    """One record per prompt (batch 1). Multi-turn prompts run as a conversation when all_turns is set. Each
    generation runs `reps` times; the fastest run's timings are kept."""
    from specjax.buckets import make_buckets

    warm: set = set()
    records = []
    for p in prompts:
        messages: list[dict] = []
        rec: dict[str, Any] = {"id": p.id, "category": p.category, "new_tokens": 0, "time": 0.0, "ttft": None,
                               "drafted": 0, "accepted": 0, "verify_steps": 0, "target_forwards": 0,
                               "pos_acc": None, "token_ids": [], "lossy": bool(spec is not None and spec.is_lossy)}
        for turn in (p.turns if all_turns else p.turns[:1]):
            messages.append({"role": "user", "content": turn})
            ids = llm.encode_prompt(messages, None)
            key = make_buckets(1, len(ids), sampling.max_new_tokens).prompt_len
            if key not in warm:  # compile outside the timed region
                llm.generate([_warmup_ids(ids)], sampling, spec)
                warm.add(key)
            wall, o = _fastest(lambda: llm.generate([messages], sampling, spec)[0], reps, llm)
            rec["wall_time"] = rec.get("wall_time", 0.0) + wall  # as run_throughput times
            m = o.metrics
            rec["new_tokens"] += m.new_tokens
            rec["time"] += m.total_time
            rec["ttft"] = m.time_to_first_token if rec["ttft"] is None else rec["ttft"]
            rec["token_ids"].append(o.token_ids)
            if m.drafted is not None:
                rec["drafted"] += m.drafted
                rec["accepted"] += m.accepted
                rec["verify_steps"] += m.verify_steps
                rec["target_forwards"] += m.target_forwards - 1  # prefill is not a decoding step
                rec["pos_num"] = rec.get("pos_num", 0) + np.asarray(m.per_position_accepted)
                rec["pos_den"] = rec.get("pos_den", 0) + np.asarray(m.per_position_drafted)
            messages.append({"role": "assistant", "content": o.text})
        records.append(rec)
        if progress is not None:
            progress(rec)
    return records


def _spec_figures(drafted: int, accepted: int, verify_steps: int, forwards: int) -> dict:
    """alpha, tau (per verify step) and tokens per decoding target forward (prefill excluded) of pooled counts."""
    # specjax.requests pulls in JAX; imported here so that importing this module (`specjax --help`) stays fast
    from specjax.requests import tau, tokens_per_forward

    return {"acceptance_rate": accepted / drafted if drafted else 0.0, "tau": tau(accepted, verify_steps),
            "tokens_per_forward": tokens_per_forward(accepted, forwards)}


def aggregate(records: list[dict]) -> dict:
    toks = sum(r["new_tokens"] for r in records)
    t = sum(r["time"] for r in records)
    # The decode phase alone (after the first token): what speculation changes, without the prompt's prefill,
    # which plain and speculative decoding share and which dominates long prompts on a CPU.
    dtoks = sum(max(r["new_tokens"] - 1, 0) for r in records)
    dt = sum(max(r["time"] - (r["ttft"] or 0.0), 0.0) for r in records)
    out = {"requests": len(records), "new_tokens": toks, "time_s": t, "tokens_per_s": toks / t if t else 0.0,
           "decode_tokens_per_s": dtoks / dt if dt else 0.0,
           "ttft_ms_p50": 1000 * float(np.median([r["ttft"] for r in records])),
           "latency_s_p50": float(np.percentile([r["time"] for r in records], 50)),
           "latency_s_p90": float(np.percentile([r["time"] for r in records], 90))}
    out["lossy"] = any(r.get("lossy", False) for r in records)
    checked = [r["identical_to_plain"] for r in records if "identical_to_plain" in r]
    if checked:  # greedy runs: how many outputs equal plain greedy token for token
        out["identical_to_plain"] = [int(sum(checked)), len(checked)]
    drafted = sum(r["drafted"] for r in records)
    if any("pos_num" in r for r in records):
        out.update(_spec_figures(drafted, sum(r["accepted"] for r in records), sum(r["verify_steps"] for r in records),
                                 sum(r["target_forwards"] for r in records)))
        num = sum(r["pos_num"] for r in records if "pos_num" in r)
        den = sum(r["pos_den"] for r in records if "pos_den" in r)
        out["per_position"] = [float(a / d) if d else 0.0 for a, d in zip(np.atleast_1d(num), np.atleast_1d(den))]
    return out


def summarize(results: dict[str, list[dict]]) -> dict:
    """{method: records} -> {method: {category|'overall': aggregate + speedup vs 'plain'}}."""
    cats = sorted({r["category"] for recs in results.values() for r in recs})
    table: dict[str, dict] = {}
    for method, recs in results.items():
        table[method] = {c: aggregate([r for r in recs if r["category"] == c]) for c in cats}
        table[method]["overall"] = aggregate(recs)
    if "plain" in table:
        for method in table:
            for c, agg in table[method].items():
                base = table["plain"][c]["tokens_per_s"]
                agg["speedup"] = agg["tokens_per_s"] / base if base else float("nan")
                dbase = table["plain"][c]["decode_tokens_per_s"]
                agg["decode_speedup"] = agg["decode_tokens_per_s"] / dbase if dbase else float("nan")
    return table


def _warmup_ids(ids: list[int]) -> list[int]:
    """A prompt of the same length (same compiled shapes) but other text: warming up on the measured prompt
    itself would put its answer into the suffix drafter's global cache and inflate its acceptance."""
    return ids[::-1]


def _first_turn(p: BenchPrompt) -> list[dict]:
    return [{"role": "user", "content": p.turns[0]}]


def _bucket_key(llm, chats: list[list[dict]], max_new: int) -> tuple[int, int]:
    """(batch bucket, prompt bucket) of one generate call: a new key means a new compilation."""
    from specjax.buckets import make_buckets

    longest = max(len(llm.encode_prompt(c, None)) for c in chats)
    b = make_buckets(len(chats), longest, max_new)
    return b.batch, b.prompt_len


def run_throughput(llm, prompts: Sequence[BenchPrompt], spec: SpeculativeConfig | None, sampling: SamplingParams,
                   batch: int, reps: int = 1) -> tuple[dict, list[list[int]]]:
    """The first turn of every prompt, `batch` prompts per `llm.generate` call; each new shape bucket is run
    once untimed first. Times whole calls (tokenization and detokenization included), like `wall_time` of
    `run_requests`, each call the fastest of `reps` runs. Returns (figures, new token ids per prompt in dataset
    order)."""
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    chunks = [[_first_turn(p) for p in prompts[i:i + batch]] for i in range(0, len(prompts), batch)]
    warm: set = set()
    outs: list = []
    wall = 0.0  # seconds inside the timed generate calls (tokenization included)
    for chats in chunks:
        key = _bucket_key(llm, chats, sampling.max_new_tokens)
        if key not in warm:  # compile outside the timed region
            llm.generate([_warmup_ids(llm.encode_prompt(c, None)) for c in chats], sampling, spec)
            warm.add(key)
        t, got = _fastest(lambda: llm.generate(chats, sampling, spec), reps, llm)
        outs.extend(got)
        wall += t
    fig = throughput_figures([o.metrics for o in outs], wall, batch, len(chunks))
    fig["effective_batch"] = max(map(len, chunks))  # below `batch` when there are fewer prompts
    return fig, [o.token_ids for o in outs]


def throughput_figures(metrics: Sequence, wall: float, batch: int, calls: int) -> dict:
    """tokens/s over the wall time of all calls; alpha, tau (1 + accepted / verify steps) and tokens per target
    forward ((accepted + decoding forwards) / decoding forwards, prefill excluded as in `run_requests`) pooled
    over the requests' own counters."""
    toks = sum(m.new_tokens for m in metrics)
    out: dict[str, Any] = {"batch": batch, "requests": len(metrics), "calls": calls, "new_tokens": toks,
                           "time_s": wall, "tokens_per_s": toks / wall if wall else 0.0,
                           "lossy": any(m.lossy for m in metrics)}
    spec = [m for m in metrics if m.drafted is not None]
    if spec:
        out.update(_spec_figures(sum(m.drafted for m in spec), sum(m.accepted for m in spec),
                                 sum(m.verify_steps for m in spec), sum(m.target_forwards - 1 for m in spec)))
    return out


def batch1_figures(records: list[dict]) -> dict:
    """The batch-1 point of the throughput table from `run_requests` records, over their wall times."""
    wall = sum(r["wall_time"] for r in records)
    toks = sum(r["new_tokens"] for r in records)
    agg = aggregate(records)
    out = {"batch": 1, "requests": len(records), "calls": len(records), "new_tokens": toks, "time_s": wall,
           "tokens_per_s": toks / wall if wall else 0.0, "lossy": agg["lossy"]}
    out.update({k: agg[k] for k in ("acceptance_rate", "tau", "tokens_per_forward") if k in agg})
    return out


def greedy_equal(batch1: Sequence[dict], token_ids: Sequence[Sequence[int]]) -> bool:
    """Batch-1 records (first turn) against the first-turn outputs of a larger batch, prompt by prompt."""
    if len(batch1) != len(token_ids):
        raise ValueError(f"{len(batch1)} batch-1 records but {len(token_ids)} batched outputs")
    return all(list(r["token_ids"][0]) == list(t) for r, t in zip(batch1, token_ids))


def run_profile(llm, prompts: Sequence[BenchPrompt], spec: SpeculativeConfig, sampling: SamplingParams) -> dict:
    """Draft against verify time at batch 1 over `prompts` (first turns), through the host-stepped loop:
    `LLM.generate` has no profile switch, so this calls `speculative.generate(..., profile=True)` as it does."""
    from specjax.runners import speculative

    warm: set = set()
    draft = verify = 0.0  # seconds
    steps = toks = 0
    for p in prompts:
        chats = [_first_turn(p)]
        ids = [llm.encode_prompt(chats[0], None)]
        key = _bucket_key(llm, chats, sampling.max_new_tokens)
        if key not in warm:  # the host-stepped functions compile apart from the fused loop
            speculative.generate(llm, chats, ids, [sampling], spec, profile=True)
            warm.add(key)
        m = speculative.generate(llm, chats, ids, [sampling], spec, profile=True)[0].metrics
        draft += m.draft_time
        verify += m.verify_time
        steps += m.target_forwards - 1  # one verify forward per host step; prefill excluded
        toks += m.new_tokens
    return profile_figures(draft, verify, steps, toks, len(prompts), spec.is_lossy)


def profile_figures(draft: float, verify: float, steps: int, new_tokens: int, requests: int, lossy: bool) -> dict:
    """draft / verify seconds -> shares and per-step means (ms)."""
    busy = draft + verify
    return {"requests": requests, "new_tokens": new_tokens, "steps": steps, "draft_s": draft, "verify_s": verify,
            "draft_share": draft / busy if busy else 0.0,
            "verify_ms_per_step": 1000 * verify / steps if steps else 0.0,
            "draft_ms_per_step": 1000 * draft / steps if steps else 0.0, "lossy": lossy}


def environment(llm) -> dict:
    import jax

    import specjax
    from specjax.backends import ops

    return {"specjax": specjax.__version__, "jax": jax.__version__, "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "model": llm.model_spec, "dtype": llm.dtype,
            "quantization": llm.quantization, "quantized_lm_head": llm.quantized_lm_head,
            "kv_cache_dtype": llm.kv_cache_dtype,
            "attention_impl": llm.attention_impl, "backend": llm.backend,
            "cpu_matmul": ops.policy("matmul"), "cpu_attention": ops.policy("attention"),
            "cpu_kv_write": ops.policy("kv_write"), "quant_matmul": ops.policy("quant_matmul"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
