"""Load test of `specjax serve` on the real model (a script, not a test): localhost only, bounded in requests.

    python benchmarks/load.py                        # 200 requests x 64 tokens, concurrency 1, 4, 16, plain + ngram
    python benchmarks/load.py --requests 20 --concurrency 4 16 --methods plain ngram --faults
    python benchmarks/load.py --requests 200 --concurrency 16 --repeat 5 --methods plain --max-tokens 24  # soak

For each method (plain decoding, n-gram speculation) a `specjax serve` subprocess is started on 127.0.0.1 at a
free port, and for each concurrency level N chat requests (Spec-Bench first turns, greedy, max_tokens 64,
streamed with include_usage) are sent through the `openai` client, at most `concurrency` at a time. Checked and
reported per level:
  * every response's text equals the offline greedy run (`specjax batch`, `runners.batch.run_job`, plain, on the
    same prompts), mismatches listed;
  * throughput (completion tokens / wall time), p50 / p99 time to first token (first content chunk, client side)
    and latency;
  * the growth of /metrics counters over the level equals the sums of the per-response `usage` and `spec_decode`
    objects (requests, generation tokens, drafts, drafted and accepted tokens, accepted per position);
  * the server's RSS and XLA compile count (/metrics) after each level: flat after the warm-up.
Throughput at the highest concurrency is compared with `specjax batch` on the same prompts (batch size =
--max-batch, its second run timed, so compilation is excluded from both).

--faults runs, on the last method's server after its clean levels: streaming clients of which 20% disconnect
after their first chunk, malformed JSON bodies, max_tokens past the server's limit, and a burst past the queue
limit (max_batch + max_queue + 16 requests at once); the served requests must still complete with the offline
text, the rejected ones get 400 / 429, and the server is left with nothing running and flat RSS / compiles.

Figures go to stdout and to --out (JSON; default reports/serve/load.json) with a Markdown table next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_BENCH = os.path.join(os.path.dirname(ROOT), "shared", "data", "spec_bench", "question.jsonl")
METHODS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4}}
NAME = "smollm2-135m"


def load_prompts(path: str, n: int) -> list[str]:
    """The first turns of the Spec-Bench questions, in file order, cycled up to n."""
    with open(path) as f:
        turns = [json.loads(line)["turns"][0] for line in f if line.strip()]
    return [turns[i % len(turns)] for i in range(n)]


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank rule; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition: {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


# ------------------------------------------------------------------------------------------------- offline


def offline_reference(llm, prompts: list[str], max_tokens: int, batch: int, workdir: str) -> tuple[list[str], dict]:
    """Greedy texts from `specjax batch` (plain, chat template) and its throughput, second run timed."""
    from specjax.runners.batch import run_job

    inp = os.path.join(workdir, "batch_in.jsonl")
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": p}]}) + "\n")
    runs = []
    for k in range(2):  # the first compiles; the second is timed
        out = os.path.join(workdir, f"batch_out{k}.jsonl")
        summary = run_job(llm, inp, out, sampling={"max_tokens": max_tokens, "temperature": 0}, batch_size=batch,
                          progress=False, err=open(os.devnull, "w"))
        runs.append((summary, out))
    summary, out = runs[-1]
    texts = [""] * len(prompts)
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            texts[int(r["id"])] = r["text"]
    return texts, {"wall_s": summary.wall_time, "new_tokens": summary.new_tokens,
                   "tokens_per_s": summary.new_tokens / summary.wall_time, "batch_size": batch}


# ------------------------------------------------------------------------------------------------- server


class Server:
    """A `specjax serve` subprocess on 127.0.0.1 at a free port."""

    def __init__(self, spec, args, log_path: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specjax.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
               "--max-prompt-tokens", str(args.max_prompt_tokens), "--max-tokens", str(args.max_tokens),
               "--step-chunk", str(args.step_chunk), "--log-level", "warning", "--shutdown-timeout", "30"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{open(self.log_path).read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready after {timeout} s")

    def metrics(self) -> dict[str, float]:
        import httpx

        return metric_values(httpx.get(self.url + "/metrics", timeout=30).text)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self.log.close()
        return code


# ------------------------------------------------------------------------------------------------- clients


async def one_request(client, prompt: str, max_tokens: int, disconnect: bool = False) -> dict:
    """One streamed chat request: text, usage, spec_decode, client-side TTFT and latency."""
    t0 = time.perf_counter()
    first = None
    pieces, usage, spec, finish = [], None, None, None
    stream = await client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    try:
        async for chunk in stream:
            if chunk.choices:
                c = chunk.choices[0]
                if c.delta.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    pieces.append(c.delta.content)
                    if disconnect:
                        return {"disconnected": True}
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
                spec = (chunk.model_extra or {}).get("spec_decode")
    finally:
        await stream.close()
    return {"text": "".join(pieces), "usage": usage, "spec": spec, "finish": finish, "ttft": first,
            "latency": time.perf_counter() - t0}


async def run_level(url: str, prompts: list[str], max_tokens: int, concurrency: int,
                    disconnect_every: int = 0) -> tuple[list[dict], float]:
    """All prompts, at most `concurrency` in flight; every `disconnect_every`-th request (0: none) disconnects
    after its first chunk. Returns (results in prompt order, wall seconds)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int, p: str) -> dict:
        async with gate:
            try:
                return await one_request(client, p, max_tokens, bool(disconnect_every) and i % disconnect_every == 0)
            except Exception as e:  # reported, never fatal: the run goes on
                return {"error": f"{type(e).__name__}: {e}"}

    t = time.perf_counter()
    results = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t
    await client.close()
    return list(results), wall


def summarize(results: list[dict], reference: list[str], wall: float) -> dict:
    ok = [r for r in results if "text" in r]
    mismatch = [i for i, r in enumerate(results) if "text" in r and r["text"] != reference[i]]
    tokens = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    out = {"requests": len(results), "completed": len(ok), "errors": [r["error"] for r in results if "error" in r][:5],
           "mismatches": mismatch, "completion_tokens": tokens, "wall_s": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
           "ttft_p50_s": pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.5),
           "ttft_p99_s": pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.99),
           "latency_p50_s": pct([r["latency"] for r in ok], 0.5),
           "latency_p99_s": pct([r["latency"] for r in ok], 0.99)}
    specs = [r["spec"] for r in ok if r.get("spec")]
    if specs:
        drafted, accepted, steps = (sum(m[k] for m in specs) for k in ("drafted", "accepted", "verify_steps"))
        out.update(drafted=drafted, accepted=accepted, verify_steps=steps,
                   acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
                   tau=round(1 + accepted / steps, 4) if steps else 1.0)
    return out


def counters_match(before: dict, after: dict, results: list[dict]) -> dict:
    """/metrics growth against the sums over the responses: {name: [counter growth, response sum]} and ok."""
    ok = [r for r in results if "text" in r and r["usage"]]
    grew = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    pairs = {
        "requests": (sum(grew(k) for k in after if k.startswith("specjax:request_success_total")), len(ok)),
        "generation_tokens": (grew("specjax:generation_tokens_total"),
                              sum(r["usage"]["completion_tokens"] for r in ok)),
        "prompt_tokens": (grew("specjax:prompt_tokens_total"), sum(r["usage"]["prompt_tokens"] for r in ok)),
    }
    specs = [r["spec"] for r in ok if r.get("spec")]
    if specs:
        pairs["spec_decode_num_drafts"] = (grew("specjax:spec_decode_num_drafts_total"),
                                           sum(m["verify_steps"] for m in specs))
        pairs["spec_decode_num_draft_tokens"] = (grew("specjax:spec_decode_num_draft_tokens_total"),
                                                 sum(m["drafted"] for m in specs))
        pairs["spec_decode_num_accepted_tokens"] = (grew("specjax:spec_decode_num_accepted_tokens_total"),
                                                    sum(m["accepted"] for m in specs))
        for pos in range(len(specs[0]["per_position_accepted"])):
            key = f'specjax:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
            pairs[f"accepted_pos{pos}"] = (grew(key), sum(m["per_position_accepted"][pos] for m in specs))
    return {"ok": all(a == b for a, b in pairs.values()), **{k: list(v) for k, v in pairs.items()}}


def process_figures(m: dict) -> dict:
    return {"rss_mb": round(m.get("process_resident_memory_bytes", 0) / 2 ** 20, 1),
            "jit_compiles": m.get("specjax:jit_compiles"), "running": m.get("specjax:num_requests_running"),
            "waiting": m.get("specjax:num_requests_waiting")}


async def fault_run(server: Server, prompts: list[str], reference: list[str], args) -> dict:
    """Faults mixed with good traffic; see the module docstring."""
    import httpx

    url = server.url
    out: dict = {}
    # 1) streaming clients, 20% of which disconnect after their first chunk, with malformed bodies among them
    async with httpx.AsyncClient(timeout=60) as http:
        async def malformed(body: bytes) -> int:
            r = await http.post(url + "/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"})
            return r.status_code

        bad_bodies = [b'{"model": "x", "messages": [',
                      b'{"messages": [{"role": "user", "content": "hi"}], "tmperature": 0}',
                      json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": args.max_tokens * 100}).encode()] * 3
        level = asyncio.ensure_future(run_level(url, prompts, args.max_tokens, args.max_batch, disconnect_every=5))
        codes = await asyncio.gather(*(malformed(b) for b in bad_bodies))
        results, wall = await level
    s = summarize(results, reference, wall)
    out["mixed"] = {"disconnected": sum(1 for r in results if r.get("disconnected")),
                    "malformed_status": sorted(set(codes)), "malformed_all_400": all(c == 400 for c in codes), **s}
    # 2) a burst past the queue limit
    burst = args.max_batch + args.max_queue + 16

    async def burst_one(i: int) -> tuple[int, str, int]:
        async with httpx.AsyncClient(timeout=600) as http:
            r = await http.post(url + "/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": args.max_tokens, "temperature": 0})
            body = r.json()
            text = body["choices"][0]["message"]["content"] if r.status_code == 200 else body["error"]["message"]
            return r.status_code, text, i % len(prompts)

    t = time.perf_counter()
    got = await asyncio.gather(*(burst_one(i) for i in range(burst)))
    served = [g for g in got if g[0] == 200]
    out["burst"] = {"sent": burst, "served": len(served), "status_429": sum(1 for g in got if g[0] == 429),
                    "other_status": sorted({g[0] for g in got if g[0] not in (200, 429)}),
                    "mismatches": sum(1 for g in served if g[1] != reference[g[2]]),
                    "message_429": next((g[1] for g in got if g[0] == 429), None),
                    "wall_s": round(time.perf_counter() - t, 2)}
    await asyncio.sleep(1.0)
    out["after"] = process_figures(server.metrics())
    return out


# ------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--methods", nargs="+", default=["plain", "ngram"], choices=list(METHODS))
    ap.add_argument("--max-batch", dest="max_batch", type=int, default=16)
    ap.add_argument("--max-queue", dest="max_queue", type=int, default=32)
    ap.add_argument("--step-chunk", dest="step_chunk", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the levels this many times on one server (a soak: RSS and compiles after each)")
    ap.add_argument("--faults", action="store_true", help="run the fault mix on the last method's server")
    ap.add_argument("--no-batch", dest="batch", action="store_false",
                    help="skip `specjax batch` (then texts are not checked and there is no throughput baseline)")
    ap.add_argument("--prompts", default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--startup-timeout", dest="startup_timeout", type=float, default=1200)
    ap.add_argument("--out", default=os.path.join(ROOT, "reports", "serve", "load.json"))
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from specjax.api import LLM
    from specjax.requests import encode_prompt

    prompts = load_prompts(args.prompts, args.requests)
    llm = LLM()
    lens = [len(encode_prompt(llm.tokenizer, llm.config.vocab_size, [{"role": "user", "content": p}], True))
            for p in prompts]
    args.max_prompt_tokens = max(lens)  # the server's prompt bucket is the batch job's: same compiled shapes
    report: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": platform.node(),
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "git": _git_head(),
                    "options": {k: v for k, v in vars(args).items() if k not in ("out",)}, "levels": {}}
    workdir = tempfile.mkdtemp(prefix="specjax_load_")
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    reference = [None] * len(prompts)
    if args.batch:
        say(f"specjax batch on {len(prompts)} prompts (batch {args.max_batch}, plain greedy, {args.max_tokens} tokens)")
        reference, report["batch"] = offline_reference(llm, prompts, args.max_tokens, args.max_batch, workdir)
        say(f"  {report['batch']['tokens_per_s']:.1f} tok/s ({report['batch']['wall_s']:.1f} s)")
    del llm
    for mi, method in enumerate(args.methods):
        server = Server(METHODS[method], args, os.path.join(workdir, f"serve_{method}.log"))
        try:
            ready = server.wait_ready(args.startup_timeout)
            say(f"[{method}] server ready in {ready:.0f} s (load + compile) on {server.url}")
            levels = report["levels"][method] = {"startup_s": round(ready, 1),
                                                 "after_warmup": process_figures(server.metrics())}
            rounds = [(c, f"c{c}" if args.repeat == 1 else f"c{c}_{r + 1}")
                      for r in range(args.repeat) for c in args.concurrency]
            for c, key in rounds:
                before = server.metrics()
                results, wall = asyncio.run(run_level(server.url, prompts, args.max_tokens, c))
                after = server.metrics()
                ref = reference if args.batch else [r.get("text") for r in results]
                s = summarize(results, ref, wall)
                s["metrics_match"] = counters_match(before, after, results)
                s["process"] = process_figures(after)
                levels[key] = s
                say(f"[{method}] {key}: {s['completed']}/{s['requests']} ok, {len(s['mismatches'])} mismatches, "
                    f"{s['tokens_per_s']:.1f} tok/s, TTFT p50 {_ms(s['ttft_p50_s'])} p99 {_ms(s['ttft_p99_s'])}, "
                    f"latency p50 {_ms(s['latency_p50_s'])} p99 {_ms(s['latency_p99_s'])}"
                    + (f", tau {s['tau']}" if "tau" in s else "")
                    + f", /metrics match {s['metrics_match']['ok']}, RSS {s['process']['rss_mb']} MB, "
                      f"compiles {s['process']['jit_compiles']}")
            if args.batch:
                top = levels[[key for c, key in rounds if c == max(args.concurrency)][-1]]
                levels["vs_batch"] = round(top["tokens_per_s"] / report["batch"]["tokens_per_s"], 3)
                say(f"[{method}] c={max(args.concurrency)} throughput / specjax batch = {levels['vs_batch']:.2f}")
            if args.faults and mi == len(args.methods) - 1:
                f = asyncio.run(fault_run(server, prompts, reference if args.batch else [None] * len(prompts), args))
                levels["faults"] = f
                say(f"[{method}] faults: {json.dumps(f)}")
        finally:
            levels_code = server.stop()
            report["levels"].setdefault(method, {})["exit_code"] = levels_code
            say(f"[{method}] server stopped, exit code {levels_code}")
    report["load_avg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown(report))
    say(f"wrote {args.out}")
    return 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def markdown(report: dict) -> str:
    """The figures as a Markdown table."""
    lines = [f"Command: `{report['command']}` (git {report['git']}, {report['cpus']} CPUs, load average "
             f"{report['load_avg_start'][0]:.1f} at start, {report['load_avg_end'][0]:.1f} at end)", ""]
    if "batch" in report:
        b = report["batch"]
        lines += [f"`specjax batch` (batch {b['batch_size']}): {b['tokens_per_s']:.1f} tok/s", ""]
    lines += ["| method | concurrency | ok | mismatches | tok/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 "
              "| tau | /metrics = responses | RSS MB | compiles |", "|" + "---|" * 13]
    for method, levels in report["levels"].items():
        for key, s in levels.items():
            if not (key.startswith("c") and isinstance(s, dict)):
                continue
            level = key[1:].replace("_", ", round ")
            lines.append(f"| {method} | {level} | {s['completed']}/{s['requests']} | {len(s['mismatches'])} | "
                         f"{s['tokens_per_s']:.1f} | {_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p99_s'])} | "
                         f"{_ms(s['latency_p50_s'])} | {_ms(s['latency_p99_s'])} | {s.get('tau', '-')} | "
                         f"{s['metrics_match']['ok']} | {s['process']['rss_mb']} | {s['process']['jit_compiles']} |")
        if "vs_batch" in levels:
            lines.append(f"| {method} | vs batch | | | {levels['vs_batch']:.2f}x | | | | | | | | |")
    for method, levels in report["levels"].items():
        if "faults" in levels:
            lines += ["", f"Faults ({method}): `{json.dumps(levels['faults'])}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
