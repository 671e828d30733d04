"""Soak run: many requests through one `specjax batch` job on the real model, watching resident memory and the
compile count after warm-up. Growth in either would mean a leak (host buffers kept per request, device buffers
not donated) or a shape that escapes the job's fixed buckets.

    python benchmarks/soak.py --requests 1000 --max-tokens 24 --batch-size 8 [--method ngram] \
        --json reports/reliability/soak.json

Prompts: Spec-Bench's first turns (../shared/data/spec_bench/question.jsonl, or --prompts FILE), cycled with
distinct ids, in the chat template. Prints RSS and compilations after every `--every` results, the latency
spread of the requests, and a verdict on growth after the first checkpoint (warm-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data", "spec_bench", "question.jsonl")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--method", default=None, help="speculative method (default: plain decoding)")
    ap.add_argument("--every", type=int, default=100, help="checkpoint every this many results")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    from specjax.api import LLM
    from specjax.backends.neuron import count_compilations
    from specjax.runners import batch

    with open(args.prompts) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    work = tempfile.mkdtemp(prefix="specjax-soak-")
    src, out = os.path.join(work, "in.jsonl"), os.path.join(work, "out.jsonl")
    with open(src, "w") as f:
        for i in range(args.requests):
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": texts[i % len(texts)]}],
                                "sampling": {"max_tokens": args.max_tokens}}) + "\n")
    llm = LLM()
    spec = {"method": args.method} if args.method else None
    points, latencies = [], []
    write = batch.ResultFile.write
    t0 = time.perf_counter()

    with count_compilations() as cc:
        def watched(self, record):
            write(self, record)
            latencies.append(record["metrics"]["time_s"])
            n = len(latencies)
            if n % args.every == 0:
                points.append({"results": n, "rss_mib": round(rss_bytes() / 2 ** 20, 1), "compiles": cc.compiles,
                               "traces": cc.traces, "seconds": round(time.perf_counter() - t0, 1)})
                p = points[-1]
                print(f"{n:5d} results  RSS {p['rss_mib']:8.1f} MiB  compiles {p['compiles']:3d}  "
                      f"traces {p['traces']:3d}  {p['seconds']:7.1f} s", flush=True)

        batch.ResultFile.write = watched
        try:
            summary = batch.run_job(llm, src, out, speculative=spec, batch_size=args.batch_size, chat=True,
                                    progress=False)
        finally:
            batch.ResultFile.write = write
    warm, last = points[0], points[-1]
    q = statistics.quantiles(latencies, n=100)
    result = {
        "requests": args.requests, "max_tokens": args.max_tokens, "batch_size": args.batch_size,
        "method": args.method or "plain", "completed": summary.completed, "tokens_per_s": round(summary.tokens_per_s, 1),
        "checkpoints": points,
        "rss_growth_after_warmup_mib": round(last["rss_mib"] - warm["rss_mib"], 1),
        "compiles_after_warmup": last["compiles"] - warm["compiles"],
        "traces_after_warmup": last["traces"] - warm["traces"],
        "latency_s": {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3),
                      "max": round(max(latencies), 3)},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
