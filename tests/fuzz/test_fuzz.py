"""The short fuzz run of the default suite, and checks that the fuzz harness can see what it looks for.

* Every unmutated corpus entry loads (the SmolLM2 header cut after its metadata is refused for its missing tensor
  data, by name): mutations start from files the readers accept, so a rejection is caused by the mutation.
* The fork server reports each kind of misbehaviour it exists to catch: a raw exception, an endless loop (killed
  at the time limit), an allocation past the memory limit, a native crash (SIGABRT). Without this, a harness
  that lost its children would pass every input.
* A few dozen hypothesis-generated mutated files (derandomized: the same inputs on every run), each loaded in
  a child with a time and memory limit, either load or fail with a one-line SpecjaxError naming the file.
  The long run is `python -m tests.fuzz.run --count 100000` (see run.py).
* Part assembly (`parts.py`): each of the named bad layouts (a missing part, parts swapped, a part of the other
  model, a truncated part, extra bytes) is a one-line error naming the package; an extra package changes nothing.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import corpus
from .harness import ACCEPTABLE, Limits, Worker, classify, run_case

LIMITS = Limits(timeout=20.0)


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    return corpus.build(str(tmp_path_factory.mktemp("fuzz-corpus")))


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def test_unmutated_corpus_loads(entries, worker):
    kinds = {e.name for e in entries}
    assert {"hf-llama", "gguf-llama", "eagle", "eagle3", "speculators", "medusa-fd", "medusa-vllm", "draft",
            "parts"} <= kinds
    for e in entries:
        result = worker.run(e.kind, e.path, LIMITS.timeout, LIMITS.mem_floor)
        if e.name == "smol-header":
            assert classify(result, e.path) == "rejected" and "runs past the end of the file" in result["message"]
        else:
            assert result["status"] == "ok", (e.name, result)


@pytest.mark.parametrize("how, status", [("raw", "raw"), ("hang", "timeout"), ("memory", "memory"),
                                         ("crash", "signal")])
def test_worker_catches_misbehaving_loads(worker, tmp_path, how, status):
    result = worker.run("selftest", str(tmp_path / how), 2.0 if how == "hang" else 15.0, 256 << 20)
    assert result["status"] == status, result
    assert classify(result, str(tmp_path)) not in ACCEPTABLE


def test_a_specjax_error_must_name_the_input():
    named = {"status": "specjax", "message": "/in/case1/config.json: hidden_size must be an integer"}
    assert classify(named, "/in/case1") == "rejected"
    assert classify(named, "/in/case2") == "unclear"
    assert classify({"status": "specjax", "message": "/in/case1: a\nb"}, "/in/case1") == "unclear"


@settings(max_examples=36, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_mutated_files_load_or_fail_cleanly(entries, worker, tmp_path_factory, data):
    workdir = str(tmp_path_factory.mktemp("fuzz-inputs"))
    record = run_case(data.draw, entries, worker, workdir, 0, LIMITS)
    assert record.outcome in ACCEPTABLE, (
        f"{record.outcome}: {record.entry} {record.fmt} {record.mutations}: {record.error_type}: "
        f"{record.message[:300]} (input kept at {record.path})")


def _parts_case(entries, tmp_path, change) -> str:
    """The parts entry copied to a case directory, `change(case)` applied, assembled in the worker."""
    entry = next(e for e in entries if e.name == "parts")
    case = str(tmp_path / "case")
    shutil.copytree(entry.root, case)
    change(case)
    return case


def _layout(case, edit) -> None:
    path = os.path.join(case, "layout.json")
    with open(path) as f:
        layout = json.load(f)
    edit(layout)
    with open(path, "w") as f:
        json.dump(layout, f)


def _swap(layout):
    layout[0], layout[1] = layout[1], layout[0]


def _truncate(case):
    path = os.path.join(case, "src", "a", "part04.bin")
    os.truncate(path, os.path.getsize(path) - 7)


def _append(case):
    with open(os.path.join(case, "src", "a", "part02.bin"), "ab") as f:
        f.write(b"extra")


@pytest.mark.parametrize("case_name, change, words", [
    ("missing part", lambda c: _layout(c, lambda slots: slots.__setitem__(2, None)), ["part3", "not installed"]),
    ("reordered parts", lambda c: _layout(c, _swap), ["parts reordered", "part1", "part2"]),
    ("a part of the other model", lambda c: _layout(c, lambda slots: slots.__setitem__(1, "src/b/part01.bin")),
     ["of model 'fuzz-b'"]),
    ("truncated part", _truncate, ["part4", "is truncated"]),
    ("extra bytes", _append, ["part2", "5 extra bytes"]),
    ("extra package", lambda c: _layout(c, lambda slots: slots.append("src/a/part01.bin")), None),
])
def test_part_assembly_cases(entries, worker, tmp_path, case_name, change, words):
    """Each of issue 42's part-assembly cases, in the fork server under its limits: a one-line error naming the
    case and the package, or (an extra package nobody asked for) the pinned file."""
    case = _parts_case(entries, tmp_path, change)
    result = worker.run("parts", case, LIMITS.timeout, LIMITS.mem_floor)
    if words is None:
        assert result["status"] == "ok", result
        return
    assert classify(result, case) == "rejected", (case_name, result)
    assert all(w in result["message"] for w in words), (case_name, result["message"])
    assert "pip install" in result["message"]

