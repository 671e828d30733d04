"""Start-up time: seconds from a fresh `python` process to the first generated token, cold and warm.

    python -m specjax.tools.startup [--model smollm2-135m] [--max-tokens 8] [--runs 1] [--cache-dir DIR]

Runs `from specjax import LLM; LLM(model).generate("Hello", {"max_tokens": N})` in new processes that share one
compilation cache directory (`SPECJAX_CACHE_DIR`, a fresh temporary one unless --cache-dir is given): the first
process starts cold (nothing compiled on disk), the following ones warm. Each line splits the time into
interpreter + imports, model load (reading weights and tokenizer, then the rest of `LLM()`), time to the first
token (prefill, compiles included) and the rest of the generation, and counts the persistent-cache hits and
misses and the seconds spent tracing, lowering and compiling (or reading compiled programs from the cache). A
figure, not a test: the machine's load moves it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# The measured process. It reports wall-clock (time.time) stamps, so the parent can count the interpreter's own
# start-up from the moment before it spawned the child.
_CHILD = r"""
import json, sys, time
t_main = time.time()
import jax
events = {"hits": 0, "misses": 0}
durations = {}
_NAMES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/compilation_cache/cache_retrieval_time_sec": "retrieve_s"}
def _event(name, **kw):
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1
def _duration(name, secs, **kw):
    if name in _NAMES:
        durations[_NAMES[name]] = durations.get(_NAMES[name], 0.0) + secs
jax.monitoring.register_event_listener(_event)
jax.monitoring.register_event_duration_secs_listener(_duration)
from specjax import LLM
import specjax.api as api
t_import, c_import = time.time(), time.process_time()
_read = api.load_model
def _timed_load(*args, **kwargs):
    t = time.time()
    out = _read(*args, **kwargs)
    durations["read_s"] = time.time() - t
    return out
api.load_model = _timed_load
# The moment the prefill has produced the first token: the end of the runner's start (when it is there to wrap).
import specjax.runners.base as base
first = {}
if hasattr(base, "_start"):
    _begin = base._start
    def _timed_start(*args, **kwargs):
        out = _begin(*args, **kwargs)
        first.setdefault("t_first", time.time())
        first.setdefault("c_first", time.process_time())
        return out
    base._start = _timed_start
llm = LLM(sys.argv[1])
t_load, c_load = time.time(), time.process_time()
out = llm.generate("Hello", {"max_tokens": int(sys.argv[2])})
t_done, c_done = time.time(), time.process_time()
from specjax import compile_cache
print("STARTUP " + json.dumps(dict(events, **durations, **first, t_main=t_main, t_import=t_import, t_load=t_load,
                                    t_done=t_done, c_import=c_import, c_load=c_load, c_done=c_done,
                                    ttft=out[0].metrics.time_to_first_token, text=out[0].text,
                                    cache_dir=compile_cache.enable())))
"""


def measure(model: str, max_tokens: int, cache_dir: str, extra_env: dict | None = None) -> dict:
    """One fresh process: its STARTUP record with `t_spawn` (the parent's clock just before the spawn) added.
    Raises RuntimeError with the child's stderr tail when it fails."""
    env = dict(os.environ, SPECJAX_CACHE_DIR=cache_dir, **(extra_env or {}))
    env.setdefault("JAX_PLATFORMS", "cpu")
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, model, str(max_tokens)], env=env, capture_output=True,
                          text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the measured process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("STARTUP "):]), t_spawn=t_spawn)


def split(rec: dict) -> dict:
    """Seconds of each phase of one record. Wall clock: python (interpreter start), import, load, prefill,
    first_token and total (both from the spawn). CPU time of the process since it started (all its threads):
    cpu_first_token and cpu_total, which a busy machine inflates far less than the wall clock."""
    t_first = rec.get("t_first", rec["t_load"] + rec["ttft"])
    return {"python": rec["t_main"] - rec["t_spawn"], "import": rec["t_import"] - rec["t_main"],
            "load": rec["t_load"] - rec["t_import"], "prefill": t_first - rec["t_load"],
            "first_token": t_first - rec["t_spawn"], "total": rec["t_done"] - rec["t_spawn"],
            "cpu_first_token": rec.get("c_first", float("nan")), "cpu_total": rec["c_done"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.tools.startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1, help="warm processes after the cold one")
    ap.add_argument("--cache-dir", help="cache root to use and keep (default: a fresh temporary one, removed)")
    ap.add_argument("--no-cache", action="store_true", help="also time one process with SPECJAX_COMPILATION_CACHE=0")
    args = ap.parse_args(argv)
    root = args.cache_dir or tempfile.mkdtemp(prefix="specjax-startup-")
    try:
        plan = [("cold", {})] + [("warm", {})] * args.runs
        if args.no_cache:
            plan.append(("no cache", {"SPECJAX_COMPILATION_CACHE": "0"}))
        print(f"model {args.model}, max_tokens {args.max_tokens}, cache root {root}")
        print(f"{'':9} {'---------------- wall clock, s ----------------':>48}  {'--- CPU, s ---':>15}  "
              f"{'persistent cache':>12}  {'--- inside the process, wall s ---':>34}")
        print(f"{'run':9} {'import':>7} {'load':>7} {'(read)':>7} {'prefill':>8} {'1st tok':>8} {'total':>7}  "
              f"{'1st tok':>7} {'total':>7}  {'hits':>5} {'misses':>6}  {'trace':>6} {'lower':>6} {'compile':>8} "
              f"{'(read)':>7}")
        for name, env in plan:
            rec = measure(args.model, args.max_tokens, root, env)
            s = split(rec)
            print(f"{name:9} {s['import']:7.2f} {s['load']:7.2f} {rec.get('read_s', 0):7.2f} {s['prefill']:8.2f} "
                  f"{s['first_token']:8.2f} {s['total']:7.2f}  {s['cpu_first_token']:7.2f} {s['cpu_total']:7.2f}  "
                  f"{rec['hits']:5d} {rec['misses']:6d}  {rec.get('trace_s', 0):6.2f} {rec.get('lower_s', 0):6.2f} "
                  f"{rec.get('compile_s', 0):8.2f} {rec.get('retrieve_s', 0):7.2f}")
        print("Wall clock from spawning the process (1st tok and total include the interpreter's start); load = "
              "LLM(model), of which (read) = weights and tokenizer from disk, the rest their layout and first "
              "programs. CPU = the process's CPU time, all threads. Inside the process: trace and lower = JAX tracing "
              "and StableHLO lowering (a nested function counts in its callers too), compile = XLA compiles and "
              "cache reads, of which (read) = reading the cache.")
        print(f"machine load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
              f"{os.cpu_count()} CPUs")
    finally:
        if not args.cache_dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
