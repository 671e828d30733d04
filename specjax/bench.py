"""Benchmark harness: run a prompt set through plain decoding and speculative methods, measure everything the
field compares on, per category and overall.

Datasets: Spec-Bench format (JSONL with question_id, category, turns), a JSONL of {"prompt": ...} or
{"messages": [...]}, or a plain text file with one prompt per line. Any file in these formats works; nothing is
read from a fixed location.

Timing excludes compilation: the first request of every new shape bucket is run once untimed. Batch 1 by
default (the latency setting of the papers). Figures per method and category: tokens/s, speedup over plain (ratio
of tokens/s on the same prompts), acceptance rate alpha, mean accepted length tau (tokens per target forward),
per-position acceptance, TTFT and end-to-end latency p50/p90.
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

from specjax.config import ConfigError, SamplingParams, SpeculativeConfig, load_run_config


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    turns: tuple[str, ...]


class DatasetError(ValueError):
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
    label = f"{spec.method}(k={spec.num_speculative_tokens})"
    return label, spec if spec.enabled else None


def run_requests(llm, prompts: Sequence[BenchPrompt], spec: SpeculativeConfig | None, sampling: SamplingParams,
                 all_turns: bool = False, progress=None) -> list[dict]:
    """One record per prompt (batch 1). Multi-turn prompts run as a conversation when all_turns is set."""
    from specjax.engine import make_buckets

    warm: set = set()
    records = []
    for p in prompts:
        messages: list[dict] = []
        rec: dict[str, Any] = {"id": p.id, "category": p.category, "new_tokens": 0, "time": 0.0, "ttft": None,
                               "drafted": 0, "accepted": 0, "verify_steps": 0, "target_forwards": 0,
                               "pos_acc": None, "token_ids": []}
        for turn in (p.turns if all_turns else p.turns[:1]):
            messages.append({"role": "user", "content": turn})
            ids = llm.encode_prompt(messages, None)
            key = make_buckets(1, len(ids), sampling.max_new_tokens).prompt_len
            if key not in warm:  # compile outside the timed region
                llm.generate([messages], sampling, spec)
                warm.add(key)
            o = llm.generate([messages], sampling, spec)[0]
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


def aggregate(records: list[dict]) -> dict:
    toks = sum(r["new_tokens"] for r in records)
    t = sum(r["time"] for r in records)
    out = {"requests": len(records), "new_tokens": toks, "time_s": t, "tokens_per_s": toks / t if t else 0.0,
           "ttft_ms_p50": 1000 * float(np.median([r["ttft"] for r in records])),
           "latency_s_p50": float(np.percentile([r["time"] for r in records], 50)),
           "latency_s_p90": float(np.percentile([r["time"] for r in records], 90))}
    drafted = sum(r["drafted"] for r in records)
    if any("pos_num" in r for r in records):
        acc = sum(r["accepted"] for r in records)
        fwd = sum(r["target_forwards"] for r in records)
        out["acceptance_rate"] = acc / drafted if drafted else 0.0
        out["tau"] = (acc + fwd) / fwd if fwd else 1.0
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
    return table


def environment(llm) -> dict:
    import jax

    import specjax

    return {"specjax": specjax.__version__, "jax": jax.__version__, "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "model": llm.model_spec, "dtype": llm.dtype,
            "attention_impl": llm.attention_impl, "backend": llm.backend,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def markdown(summary: dict, title: str) -> str:
    lines = [f"## {title}", ""]
    cats = [c for c in next(iter(summary.values())) if c != "overall"] + ["overall"]
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for method, per in summary.items():
        cells = []
        for c in cats:
            a = per[c]
            cell = f"{a['tokens_per_s']:.1f} tok/s"
            if "speedup" in a and method != "plain":
                cell += f", {a['speedup']:.2f}x"
            if "tau" in a:
                cell += f", α {a['acceptance_rate']:.2f}, τ {a['tau']:.2f}"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Per-position acceptance (overall): " + "; ".join(
        f"{m}: [{', '.join(f'{x:.2f}' for x in per['overall'].get('per_position', []))}]"
        for m, per in summary.items() if "per_position" in per["overall"]))
    return "\n".join(lines) + "\n"


def print_table(summary: dict, title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        print(markdown(summary, title))
        return
    cats = [c for c in next(iter(summary.values())) if c != "overall"] + ["overall"]
    t = Table(title=title)
    t.add_column("method")
    for c in cats:
        t.add_column(c, justify="right")
    for method, per in summary.items():
        row = []
        for c in cats:
            a = per[c]
            s = f"{a['tokens_per_s']:.1f}"
            if "speedup" in a and method != "plain":
                s += f" {a['speedup']:.2f}x"
            if "tau" in a:
                s += f"\nα{a['acceptance_rate']:.2f} τ{a['tau']:.2f}"
            row.append(s)
        t.add_row(method, *row)
    Console().print(t)


def plot(summary: dict, path_prefix: str, title: str) -> list[str]:
    """PNG plots: speedup by category and method, acceptance by position. Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    cats = [c for c in next(iter(summary.values())) if c != "overall"] + ["overall"]
    methods = [m for m in summary if m != "plain"]
    if methods:
        fig, ax = plt.subplots(figsize=(max(6, len(cats) * 0.9), 4))
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ax.bar(np.arange(len(cats)) + i * w, [summary[m][c].get("speedup", np.nan) for c in cats], w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(cats)) + 0.4 - w / 2, cats, rotation=30, ha="right")
        ax.set_ylabel("speedup over specjax plain")
        ax.set_title(f"{title}: speedup by category")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"{path_prefix}_speedup.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    spec = [m for m in summary if "per_position" in summary[m]["overall"]]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in spec:
            pp = summary[m]["overall"]["per_position"]
            ax.plot(np.arange(1, len(pp) + 1), pp, marker="o", label=m)
        ax.set_xlabel("draft position (depth)")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"{title}: acceptance by position")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"{path_prefix}_acceptance.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
