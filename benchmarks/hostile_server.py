"""`specjax serve` under large hostile requests (issue 44; a script, not a test): localhost only, bounded in count
and time.

    python benchmarks/hostile_server.py                          # 20 repeats, 10 small requests per phase
    python benchmarks/hostile_server.py --repeats 3 --small 3    # a smoke run

Starts `specjax serve` (smollm2-135m, n-gram speculation, the default limits) on 127.0.0.1 at a free port
(`benchmarks/load.py`'s Server) and measures:
  * refusal time of a 20 MB prompt (completion and chat; 413 before the body is read), client side;
  * a small greedy request's latency (chat, non-streamed, max_tokens --small-tokens) idle, and while large
    requests are sent back to back from another thread: 20 MB prompts (413), prompts just past the character
    limit (400 before tokenizing), and prompts just under it (tokenized on the server's pool, then refused by the
    token limit) -- the worst case for the serving loop;
  * the server process's resident memory (psutil) before, after each of --repeats rounds of those three large
    requests, and at the end.
Every answer to a large request must be a 4xx with a JSON error (counted; any 5xx fails the run). Prints a
table and writes JSON to --out (default reports/serve/hostile.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import Server  # noqa: E402  (the same subprocess server as the load test)

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
NAME = "smollm2-135m"
TWENTY_MB = 20 << 20


def small_request(client, tokens: int) -> float:
    t = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": tokens, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Count from one to ten."}]})
    if r.status_code != 200:
        raise RuntimeError(f"small request failed: {r.status_code} {r.text[:200]}")
    return time.perf_counter() - t


def large_bodies(max_chars: int) -> dict[str, bytes]:
    """The large requests, serialized once: name -> JSON body."""
    def chat(text: str) -> bytes:
        return json.dumps({"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}).encode()

    # Words, not one repeated letter: tokenizing them costs what real text costs.
    words = ("the quick brown fox jumps over a lazy dog " * (TWENTY_MB // 40 + 1))
    return {"20MB completion": json.dumps({"model": NAME, "prompt": words[:TWENTY_MB]}).encode(),
            "20MB chat": chat(words[:TWENTY_MB]),
            "past char limit": chat(words[:max_chars + 1]),
            "under char limit": chat(words[:max_chars - 64])}


def send(client, body: bytes) -> tuple[int, float, str]:
    t = time.perf_counter()
    r = client.post("/v1/completions" if b'"prompt"' in body[:64] else "/v1/chat/completions", content=body,
                    headers={"content-type": "application/json"})
    took = time.perf_counter() - t
    message = r.json().get("error", {}).get("message", "") if r.headers.get("content-type", "").startswith(
        "application/json") else r.text[:120]
    return r.status_code, took, message


def rss(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="rounds of the large requests for the RSS series")
    ap.add_argument("--small", type=int, default=10, help="small requests per latency phase")
    ap.add_argument("--small-tokens", dest="small_tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=1024)
    ap.add_argument("--max-seconds", dest="max_seconds", type=float, default=1800, help="stop every phase by then")
    ap.add_argument("--startup-timeout", dest="startup_timeout", type=float, default=1200)
    ap.add_argument("--out", default=os.path.join(ROOT, "reports", "serve", "hostile.json"))
    args = ap.parse_args(argv)
    import httpx

    deadline = time.monotonic() + args.max_seconds
    opts = SimpleNamespace(max_batch=4, max_queue=16, max_prompt_tokens=args.max_prompt_tokens,
                           max_tokens=max(64, args.small_tokens), step_chunk=4)
    log = os.path.join(os.path.dirname(args.out), "hostile_server.log")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    server = Server(SPEC, opts, log)
    out: dict = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "host": platform.node(),
                 "cpus": os.cpu_count(), "commit": _commit(), "spec": SPEC, "repeats": args.repeats,
                 "small": args.small}
    try:
        out["startup_s"] = server.wait_ready(args.startup_timeout)
        pid = server.proc.pid
        with httpx.Client(base_url=server.url, timeout=120) as c:
            # The character limit the server derived (its 400 names it), from one request just past any plausible one.
            status, _, message = send(c, json.dumps({"model": NAME, "prompt": "a" * (3 << 20)}).encode())
            max_chars = int(message.split("limit of ")[1].split()[0]) if "limit of" in message else 80000
            out["max_prompt_chars"] = max_chars
            bodies = large_bodies(max_chars)
            small_request(c, args.small_tokens)  # warm
            out["rss_start_mb"] = rss(pid)

            refusals = {name: [] for name in bodies}
            statuses: dict[str, set] = {name: set() for name in bodies}
            for _ in range(max(1, args.small)):
                for name, body in bodies.items():
                    if time.monotonic() < deadline:
                        status, took, msg = send(c, body)
                        refusals[name].append(took)
                        statuses[name].add(status)
            out["refusal_s"] = {n: {"median": statistics.median(v), "max": max(v), "n": len(v),
                                    "statuses": sorted(statuses[n])} for n, v in refusals.items() if v}

            idle = [small_request(c, args.small_tokens) for _ in range(args.small) if time.monotonic() < deadline]
            stop = threading.Event()
            loaded_statuses: list[int] = []

            def hammer():
                with httpx.Client(base_url=server.url, timeout=120) as h:
                    while not stop.is_set() and time.monotonic() < deadline:
                        for body in bodies.values():
                            loaded_statuses.append(send(h, body)[0])

            thread = threading.Thread(target=hammer, daemon=True)
            thread.start()
            time.sleep(0.5)
            loaded = [small_request(c, args.small_tokens) for _ in range(args.small) if time.monotonic() < deadline]
            stop.set()
            thread.join(300)
            out["small_latency_s"] = {"idle_median": statistics.median(idle), "idle_max": max(idle),
                                      "beside_large_median": statistics.median(loaded),
                                      "beside_large_max": max(loaded),
                                      "ratio_median": statistics.median(loaded) / statistics.median(idle),
                                      "large_sent_meanwhile": len(loaded_statuses)}

            series = [rss(pid)]
            for _ in range(args.repeats):
                if time.monotonic() > deadline:
                    break
                for body in bodies.values():
                    statuses.setdefault("rss rounds", set()).add(send(c, body)[0])
                series.append(rss(pid))
            out["rss_mb"] = {"before": series[0], "after": series[-1], "max": max(series),
                             "growth": series[-1] - series[0], "series": series}
            all_statuses = set(loaded_statuses).union(*statuses.values())
            out["statuses"] = sorted(all_statuses)
            out["ok"] = all(400 <= s < 500 for s in all_statuses)
            out["metrics_failures"] = {k: v for k, v in server.metrics().items() if "request_failure" in k}
    finally:
        out["exit_code"] = server.stop()
    _report(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if out.get("ok") else 1


def _report(out: dict) -> None:
    print(f"\nspecjax serve under large requests ({out['spec']['method']}, {out.get('cpus')} CPUs, "
          f"commit {out['commit']}; character limit {out.get('max_prompt_chars')})")
    print(f"{'request':<20} {'median s':>9} {'max s':>8} {'n':>4}  statuses")
    for name, r in out.get("refusal_s", {}).items():
        print(f"{name:<20} {r['median']:>9.3f} {r['max']:>8.3f} {r['n']:>4}  {r['statuses']}")
    lat = out.get("small_latency_s")
    if lat:
        print(f"small greedy request: idle median {lat['idle_median']:.3f} s (max {lat['idle_max']:.3f}); beside "
              f"large requests median {lat['beside_large_median']:.3f} s (max {lat['beside_large_max']:.3f}); "
              f"ratio {lat['ratio_median']:.2f} ({lat['large_sent_meanwhile']} large requests meanwhile)")
    mem = out.get("rss_mb")
    if mem:
        print(f"RSS over {len(mem['series']) - 1} rounds: before {mem['before']:.0f} MB, max {mem['max']:.0f}, "
              f"after {mem['after']:.0f} (growth {mem['growth']:+.0f} MB)")
    print(f"statuses of large requests: {out.get('statuses')}; all 4xx: {out.get('ok')}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
