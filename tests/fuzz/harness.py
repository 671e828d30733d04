"""Parent side of the fuzzer: make a mutated copy of a corpus entry, have the worker load it, judge the outcome.

Outcomes: "ok" (loaded) and "rejected" (a SpecjaxError, one line, naming the input's file) are the only
acceptable ones. Every other is a finding: "unclear" (a SpecjaxError that does not name the file or spans lines),
"raw" (any other exception), "memory" (MemoryError under the memory limit), "crash" (killed by a signal, e.g. an
abort on a failed allocation), "hang" (past the time limit), "harness" (the child produced no result).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict

import hypothesis.strategies as st

from .corpus import Entry
from .mutate import mutate

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
ACCEPTABLE = ("ok", "rejected")
FINDINGS = ("unclear", "raw", "memory", "crash", "hang", "harness")


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout: float = 20.0  # seconds per input
    mem_floor: int = 512 << 20  # address space a child may add, plus ...
    mem_per_byte: int = 64  # ... this many bytes per byte of input


class Worker:
    """One `worker.py` fork server; restarted if it ever dies."""

    def __init__(self):
        self.proc = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        ready = self.proc.stdout.readline()
        if not ready or not json.loads(ready).get("ready"):
            raise RuntimeError(f"fuzz worker did not start (said {ready!r})")

    def run(self, kind: str, path: str, timeout: float, mem: int) -> dict:
        request = {"kind": kind, "path": path, "timeout": timeout, "mem": mem}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.close()
            self.start()
            return {"status": "harness", "type": "", "message": "the fuzz worker died", "rss_kb": 0}
        return json.loads(line)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclasses.dataclass
class Record:
    entry: str
    kind: str
    fmt: str  # format of the mutated file
    mutations: list
    outcome: str
    error_type: str
    message: str
    seconds: float
    rss_mb: float
    size: int
    path: str


def classify(result: dict, root: str) -> str:
    status = result["status"]
    if status == "ok":
        return "ok"
    if status == "specjax":
        msg = result["message"]
        return "rejected" if root in msg and "\n" not in msg else "unclear"
    return {"raw": "raw", "memory": "memory", "signal": "crash", "timeout": "hang"}.get(status, "harness")


def _dir_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_case(draw, entries: list[Entry], worker: Worker, workdir: str, index: int, limits: Limits) -> Record:
    """Draw an entry, a file in it and its mutations; load the mutated copy in the worker; judge the outcome.
    The copy is deleted afterwards unless the outcome is a finding."""
    entry = draw(st.sampled_from([e for e in entries for _ in range(e.weight)]), label="entry")
    rel, fmt = draw(st.sampled_from(entry.files), label="file")
    case = os.path.join(workdir, f"case{index:07d}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(entry.root, case)
    target = os.path.join(case, rel)
    with open(target, "rb") as f:
        raw = f.read()
    try:
        new, desc = mutate(draw, fmt, raw)
    except Exception as e:  # a bug in the mutator, not in specjax: recorded as a harness finding
        return Record(entry.name, entry.kind, fmt, [], "harness", type(e).__name__, f"mutator failed: {e}"[:300],
                      0.0, 0.0, 0, case)
    except BaseException:  # hypothesis abandoned the example (its StopTest): nothing to keep
        shutil.rmtree(case, ignore_errors=True)
        raise
    with open(target, "wb") as f:
        f.write(new)
    path = case if os.path.isdir(entry.path) else os.path.join(case, os.path.basename(entry.path))
    size = _dir_size(case)
    result = worker.run(entry.kind, path, limits.timeout, limits.mem_floor + limits.mem_per_byte * size)
    outcome = classify(result, case)
    record = Record(entry.name, entry.kind, fmt, desc, outcome, result.get("type", ""), result.get("message", ""),
                    result.get("seconds", limits.timeout), round(result.get("rss_kb", 0) / 1024, 1), size, case)
    if outcome in ACCEPTABLE:
        shutil.rmtree(case, ignore_errors=True)
    return record


def normalise(message: str, path: str) -> str:
    """An error message with the input's path and all numbers blanked, to count distinct messages."""
    return re.sub(r"\d+", "N", message.replace(path, "<input>"))[:160]


class Tally:
    """Counts by entry, file format and outcome; distinct messages; peak memory; the findings themselves."""

    def __init__(self):
        self.by_entry = defaultdict(Counter)
        self.seconds_by_entry = Counter()
        self.by_format = defaultdict(Counter)
        self.outcomes = Counter()
        self.messages = Counter()
        self.findings: list[Record] = []
        self.max_rss_mb = 0.0
        self.max_seconds = 0.0
        self.count = 0

    def add(self, r: Record) -> None:
        self.count += 1
        self.by_entry[r.entry][r.outcome] += 1
        self.seconds_by_entry[r.entry] += r.seconds
        self.by_format[r.fmt][r.outcome] += 1
        self.outcomes[r.outcome] += 1
        if r.outcome == "rejected":
            self.messages[normalise(r.message, r.path)] += 1
        if r.outcome not in ACCEPTABLE:
            self.findings.append(r)
        self.max_rss_mb = max(self.max_rss_mb, r.rss_mb)
        self.max_seconds = max(self.max_seconds, r.seconds)

    def summary(self, seconds: float) -> dict:
        return {
            "inputs": self.count, "seconds": round(seconds, 1),
            "inputs_per_second": round(self.count / seconds, 2) if seconds else None,
            "outcomes": dict(self.outcomes), "findings": len(self.findings),
            "crashes": self.outcomes["crash"] + self.outcomes["raw"] + self.outcomes["harness"],
            "hangs": self.outcomes["hang"], "over_allocations": self.outcomes["memory"],
            "unclear_errors": self.outcomes["unclear"],
            "distinct_error_messages": len(self.messages),
            "max_child_rss_mb": self.max_rss_mb, "max_seconds_per_input": round(self.max_seconds, 2),
            "by_entry": {k: dict(v) for k, v in sorted(self.by_entry.items())},
            "mean_seconds_by_entry": {k: round(self.seconds_by_entry[k] / sum(v.values()), 3)
                                      for k, v in sorted(self.by_entry.items())},
            "by_format": {k: dict(v) for k, v in sorted(self.by_format.items())},
            "common_error_messages": [f"{n} x {m}" for m, n in self.messages.most_common(40)],
            "first_findings": [dataclasses.asdict(r) for r in self.findings[:20]],
        }


def fuzz(entries: list[Entry], count: int, seed: int, workdir: str, limits: Limits = Limits(),
         progress=None) -> tuple[Tally, float]:
    """Run `count` hypothesis-generated inputs (no shrinking: every example is recorded, none asserted)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    tally = Tally()
    worker = Worker()
    index = [0]

    @hyp_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data):
        index[0] += 1
        record = run_case(data.draw, entries, worker, workdir, index[0], limits)
        tally.add(record)
        if progress:
            progress(tally)

    start = time.monotonic()
    try:
        one()
    finally:
        worker.close()
    return tally, time.monotonic() - start
