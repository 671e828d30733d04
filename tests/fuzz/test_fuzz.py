"""The short fuzz run of the default suite, and checks that the fuzz harness can see what it looks for.

* Every unmutated corpus entry loads (the SmolLM2 header cut after its metadata is refused for its missing tensor
  data, by name): mutations start from files the readers accept, so a rejection is caused by the mutation.
* The fork server reports each kind of misbehaviour it exists to catch: a raw exception, an endless loop (killed
  at the time limit), an allocation past the memory limit, a native crash (SIGABRT). Without this, a harness
  that lost its children would pass every input.
* A few dozen hypothesis-generated mutated files (derandomized: the same inputs on every run), each loaded in
  a child with a time and memory limit, either load or fail with a one-line SpecjaxError naming the file.
  The long run is `python -m tests.fuzz.run --count 100000` (see run.py).
"""
from __future__ import annotations

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
    assert {"hf-llama", "gguf-llama", "eagle", "eagle3", "speculators", "medusa-fd", "medusa-vllm", "draft"} <= kinds
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
