"""`specjax batch`: continuous batching with slot refill, resume, crash safety and bad input.

A tiny random Llama (2 layers, hidden 32, byte-level vocabulary) keeps every compile short. The plain-decoding
tests share one set of shape buckets (prompts of at most 16 bytes, at most 16 new tokens, 3 slots), so the job's
three programs compile once per process; a test then checks that a second job compiles nothing at all.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import serve_helpers
from specjax.runners import batch, serving
from specjax.api import LLM
from specjax.models.llama import LlamaConfig, init_params
from specjax.models.tokenizer import TokenizerError

SEED = 0
EOS = 256
SLOTS = 3


class ByteTokenizer:
    """Byte-level stand-in for the model tokenizer: ids 0..255 are bytes, 256 is the end-of-sequence token."""

    stop_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(t) for t in ids if int(t) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TokenizerError(f"message {i} needs string 'role' and 'content'")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


def tiny_llm(seed: int = SEED, max_context: int = 512) -> LLM:
    """The serving tests' tiny model (`serve_helpers.tiny_llm`) with the byte-level tokenizer."""
    return serve_helpers.tiny_llm(seed, ByteTokenizer(), max_context)


def make_requests(n: int, start: int = 0) -> list[dict]:
    """n requests of 1..16 bytes and 3..16 new tokens (one shape bucket), string and integer ids, some chat."""
    out = []
    for i in range(start, start + n):
        r = {"id": f"r{i}" if i % 2 else i, "sampling": {"max_tokens": 3 + (i * 5) % 14}}
        if i % 5 == 4:
            r["messages"] = [{"role": "u", "content": f"m{i}"}]
        else:
            r["prompt"] = ("ab" * 8 + str(i))[i % 7:][:16]
        out.append(r)
    return out


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def read_results(path) -> list[dict]:
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"" or data.endswith(b"\n"), "output must end with a complete line"
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def by_id(results) -> dict:
    out = {}
    for r in results:
        key = json.dumps(r["id"])
        assert key not in out, f"id {key} written twice"
        out[key] = r
    return out


class Err:
    """A stderr stand-in that keeps the text."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def job(llm, inp, out, **kw):
    err = Err()
    kw.setdefault("batch_size", SLOTS)
    summary = batch.run_job(llm, str(inp), str(out), progress=False, err=err, **kw)
    return summary, err.text


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.fixture(scope="module")
def clean(llm, tmp_path_factory):
    """The uninterrupted plain greedy run of 14 requests: (input path, {id key: result})."""
    d = tmp_path_factory.mktemp("clean")
    inp = write_jsonl(d / "in.jsonl", make_requests(14))
    summary, _ = job(llm, inp, d / "out.jsonl")
    assert summary.completed == 14
    return inp, by_id(read_results(d / "out.jsonl"))


# ----------------------------------------------------------------------------------------------- the job


def test_refilled_batch_matches_one_request_at_a_time(llm, clean):
    """14 requests through 3 slots, max_new_tokens 3..16: every id exactly once, with the tokens that a
    batch-1 `LLM.generate` of the same request gives (refilled slots carry no state of their predecessor)."""
    inp, results = clean
    reqs = [json.loads(line) for line in open(inp)]
    assert len(results) == len(reqs) == 14
    reasons = set()
    for r in reqs:
        got = results[json.dumps(r["id"])]
        ref = llm.generate([r.get("prompt", r.get("messages"))], r["sampling"])[0]  # greedy: seed-free
        assert got["token_ids"] == ref.token_ids, r["id"]
        assert got["text"] == ref.text
        assert got["finish_reason"] == ref.finish_reason
        assert got["metrics"]["new_tokens"] == len(got["token_ids"]) <= r["sampling"]["max_tokens"]
        assert got["metrics"]["prompt_tokens"] == len(ref.prompt_token_ids)
        reasons.add(got["finish_reason"])
    assert "length" in reasons


def test_second_job_compiles_nothing(llm, clean, tmp_path):
    """Fixed buckets: a different mix of requests (other prompts, lengths, count) reuses the compiled programs."""
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    inp = write_jsonl(tmp_path / "in.jsonl", make_requests(7, start=20))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        summary, _ = job(llm, inp, tmp_path / "out.jsonl")
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert summary.completed == 7
    assert compiles == []


def test_sampled_job_is_reproducible_and_seeds_differ_per_id(llm, tmp_path):
    """temperature > 0: seeds derive from (job seed, id), so a rerun (as after a crash) draws the same tokens,
    while the same prompt under two ids samples independently."""
    rows = [{"id": i, "prompt": "abab", "sampling": {"temperature": 1.0, "max_tokens": 16}} for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    job(llm, inp, tmp_path / "a.jsonl")
    job(llm, inp, tmp_path / "b.jsonl")
    a, b = by_id(read_results(tmp_path / "a.jsonl")), by_id(read_results(tmp_path / "b.jsonl"))
    assert {k: v["token_ids"] for k, v in a.items()} == {k: v["token_ids"] for k, v in b.items()}
    assert len({tuple(v["token_ids"]) for v in a.values()}) > 1


# ----------------------------------------------------------------------------------------------- resume


def test_resume_skips_ids_already_written(llm, clean, tmp_path):
    inp, results = clean
    out = tmp_path / "out.jsonl"
    keys = list(results)
    # A result the job would never produce: if resume regenerated it, the text would change.
    first = dict(results[keys[0]], text="KEPT AS WRITTEN")
    head = [first] + [results[k] for k in keys[1:4]]
    write_jsonl(out, [json.dumps(r) for r in head])
    before = out.read_bytes()
    summary, _ = job(llm, inp, out)
    assert (summary.already_done, summary.completed) == (4, 10)
    assert out.read_bytes().startswith(before)
    got = by_id(read_results(out))
    assert set(got) == set(results)
    assert got[keys[0]]["text"] == "KEPT AS WRITTEN"
    for k in keys[4:]:
        assert got[k]["token_ids"] == results[k]["token_ids"]
    summary, _ = job(llm, inp, out)  # everything done: nothing to do, nothing written
    assert (summary.already_done, summary.completed) == (14, 0)
    assert len(read_results(out)) == 14


@pytest.mark.parametrize("tail", [b'{"id": 7, "text": "half a li', b"\x00\x00\x00\n", b'{"id": 7, "te\n'],
                         ids=["no-newline", "zeros", "torn-json"])
def test_torn_last_line_is_repaired(llm, clean, tmp_path, tail):
    inp, results = clean
    out = tmp_path / "out.jsonl"
    keys = list(results)
    out.write_bytes(b"".join(json.dumps(results[k]).encode() + b"\n" for k in keys[:3]) + tail)
    summary, err = job(llm, inp, out)
    assert "removed an incomplete last line" in err
    assert (summary.already_done, summary.completed) == (3, 11)
    got = by_id(read_results(out))
    assert set(got) == set(results)
    assert all(got[k]["token_ids"] == results[k]["token_ids"] for k in keys)


def test_corrupt_line_inside_output_stops_the_job(llm, clean, tmp_path):
    inp, results = clean
    out = tmp_path / "out.jsonl"
    keys = list(results)
    text = json.dumps(results[keys[0]]) + "\nnot json\n" + json.dumps(results[keys[1]]) + "\n"
    out.write_text(text)
    with pytest.raises(batch.BatchError, match="line 2 is not a result line"):
        job(llm, inp, out)
    assert out.read_text() == text


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_lines_are_reported_and_skipped(llm, tmp_path):
    good = make_requests(4)
    lines = [
        json.dumps(good[0]),                                                  # 1 ok
        '{"id": 1, "prompt": "ab"',                                           # 2 malformed JSON
        json.dumps({"prompt": "no id"}),                                      # 3 missing id
        json.dumps(good[1]),                                                  # 4 ok
        json.dumps(dict(good[2], id=good[1]["id"])),                          # 5 duplicate of line 4
        json.dumps({"id": "x1", "sampling": {"max_tokens": 4}}),              # 6 neither prompt nor messages
        json.dumps({"id": "x2", "prompt": "ab", "sampling": {"temperature": -1}}),  # 7 invalid sampling
        json.dumps({"id": "x3", "prompt": "ab", "sampling": {"temprature": 1}}),    # 8 unknown sampling key
        json.dumps({"id": "x4", "messages": [{"role": "u"}]}),                # 9 message without content
        json.dumps({"id": "x5", "prompt": "a" * 600}),                        # 10 longer than the context
        json.dumps({"id": 1.5, "prompt": "ab"}),                              # 11 float id
        "",                                                                   # 12 blank: ignored
        json.dumps([1, 2]),                                                   # 13 not an object
        json.dumps(good[3]),                                                  # 14 ok
        json.dumps({"id": "x6", "prompt": "ab", "messages": [{"role": "u", "content": "c"}]}),  # 15 both
        # Poison lines that once crashed the whole job, again on every rerun:
        "[" * 100000 + "]" * 100000,                                          # 16 nesting past the recursion limit
        '{"id": ' + "9" * 5000 + ', "prompt": "ab"}',                         # 17 a 5000-digit id
        json.dumps({"id": "x7", "prompt": "ab", "sampling": {"top_k": 2 ** 31}}),  # 18 past int32
        '{"id": "x8", "prompt": "a \\ud800 b"}',                            # 19 a lone surrogate
        json.dumps({"id": "x9", "messages": [{"role": "user", "content": None}]}),  # 20 content None
        json.dumps({"id": "x10", "prompt": "ab", "sampling": {"stop_token_ids": [2 ** 40]}}),  # 21 past int32
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    digest = hashlib.sha256(inp.read_bytes()).hexdigest()
    summary, err = job(llm, inp, tmp_path / "out.jsonl")
    expect = {2: "invalid JSON", 3: "missing 'id'", 5: "duplicate id", 6: "needs exactly one of 'prompt'",
              7: "sampling.temperature", 8: "did you mean 'temperature'", 9: "message 0", 10: "context of 512",
              11: "'id' must be a string or an integer", 13: "expected a JSON object", 15: "it has both",
              16: "nested too deeply", 17: "an integer of 5000 digits", 18: "sampling.top_k", 19: "lone surrogate",
              20: "content of type NoneType", 21: "sampling.stop_token_ids[0]"}
    for n, what in expect.items():
        line = next((ln for ln in err.splitlines() if f"in.jsonl:{n}: " in ln), "")
        assert what in line, (n, err)
    assert "first used on line 4" in err
    assert summary.skipped_lines == len(expect)
    assert (summary.requests, summary.completed) == (3, 3)
    assert {json.dumps(r["id"]) for r in read_results(tmp_path / "out.jsonl")} == \
        {json.dumps(good[i]["id"]) for i in (0, 1, 3)}
    assert hashlib.sha256(inp.read_bytes()).hexdigest() == digest


def test_unusable_files_fail_before_any_work(llm, tmp_path):
    rows = make_requests(3)
    csv = tmp_path / "in.csv"
    csv.write_text("id,prompt\n1,hello\n")
    arr = tmp_path / "arr.jsonl"
    arr.write_text(json.dumps(rows, indent=1))
    text = tmp_path / "prompts.txt"
    text.write_text("hello\nworld\n")
    good = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cases = [(csv, out, "unsupported format '.csv'"), (arr, out, "JSON array"), (text, out, "not JSONL"),
             (tmp_path / "missing.jsonl", out, "does not exist"),
             (good, tmp_path / "no" / "such" / "out.jsonl", "does not exist; create it first"),
             (good, tmp_path, "is a directory"), (good, good, "is the input file")]
    for inp, outp, what in cases:
        with pytest.raises(batch.BatchError, match=what):
            job(llm, inp, outp)
        assert not out.exists()  # nothing started, nothing created
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(batch.BatchError, match="permission denied"):
            job(llm, good, ro / "out.jsonl")


def test_cli_reports_format_errors_without_loading_a_model(tmp_path, capsys):
    import argparse

    from specjax.cli import batch as batch_cli

    p = argparse.ArgumentParser()
    batch_cli.add_arguments(p)
    csv = tmp_path / "in.csv"
    csv.write_text("id,prompt\n")
    args = p.parse_args([str(csv), str(tmp_path / "out.jsonl"), "--batch-size", "4", "--model", "nonexistent"])
    assert batch_cli.run(args) == 2
    assert "unsupported format '.csv'" in capsys.readouterr().err


def test_a_second_job_on_the_same_output_is_refused(llm, clean, tmp_path):
    inp, _ = clean
    out = tmp_path / "out.jsonl"
    holder = batch.ResultFile(str(out))
    try:
        with pytest.raises(batch.BatchError, match="another running job"):
            job(llm, inp, out)
    finally:
        holder.close()


# ----------------------------------------------------------------------------------------------- speculative


@pytest.mark.slow
def test_ngram_job_is_lossless_and_reports_acceptance(llm, clean, tmp_path):
    """Greedy n-gram speculation in refilled slots gives the plain tokens; metrics carry acceptance and tau."""
    inp, results = clean
    summary, err = job(llm, inp, tmp_path / "out.jsonl", speculative={"method": "ngram", "num_speculative_tokens": 3})
    got = by_id(read_results(tmp_path / "out.jsonl"))
    assert {k: v["token_ids"] for k, v in got.items()} == {k: v["token_ids"] for k, v in results.items()}
    m = next(iter(got.values()))["metrics"]
    assert {"acceptance_rate", "tau", "tokens_per_forward", "drafted", "accepted", "verify_steps"} <= set(m)
    for v in got.values():  # tau per verify step, tokens per forward over verify and plain steps
        r = v["metrics"]
        assert r["tau"] == pytest.approx(1 + r["accepted"] / r["verify_steps"] if r["verify_steps"] else 1.0, abs=1e-4)
        fwd = r["verify_steps"] + r["plain_steps"]
        assert r["tokens_per_forward"] == pytest.approx((r["accepted"] + fwd) / fwd, abs=1e-4)
    assert summary.drafted == sum(v["metrics"]["drafted"] for v in got.values()) > 0
    assert summary.tau == pytest.approx(1 + summary.accepted / summary.verify_steps)
    assert "acceptance" in err and "tau" in err and "tokens per target forward" in err


def test_every_state_leaf_is_batch_first(llm):
    """`insert_row` moves a request by scattering row 0 of every leaf: that needs every leaf of the plain and
    speculative states (drafter caches included) to lead with the batch axis. Checked by tracing only."""
    from specjax import engine
    from specjax.buckets import make_buckets
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.ngram import NgramDrafter

    dcfg = LlamaConfig(vocab_size=264, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_position_embeddings=512)
    dparams = {"params": init_params(dcfg, jax.random.PRNGKey(1), jnp.float32)}
    buckets = make_buckets(1, 16, 16, extra_slots=4)
    sampling = llm.sampling_arrays([batch.SamplingParams()] * 5, 5, buckets.num_stop)
    for drafter, dp in ((None, None), (NgramDrafter(3), {}), (DraftModelDrafter(dcfg, 3, 264), dparams)):
        state = serving.programs(llm, buckets, 5, drafter, dp).empty(sampling)
        leaves = jax.tree_util.tree_leaves(state)
        assert len(leaves) > 6 and all(a.shape[0] == 5 for a in leaves), drafter
        finish = state.finish if drafter is None else state.dec.finish
        assert (finish != engine.FINISH_RUNNING).all()  # every slot starts free


@pytest.mark.slow
def test_neuron_policy_job_matches_default(clean, tmp_path):
    """Under the Neuron compile policy (straight-line fused steps, no cond / data-dependent loop; here on the CPU
    fallback) the same job gives the same greedy tokens; 3 slots round up to the Neuron batch bucket 4."""
    inp, results = clean
    neuron_llm = tiny_llm()
    neuron_llm.backend = "neuron"
    summary, _ = job(neuron_llm, inp, tmp_path / "out.jsonl")
    assert summary.completed == 14
    got = by_id(read_results(tmp_path / "out.jsonl"))
    assert {k: v["token_ids"] for k, v in got.items()} == {k: v["token_ids"] for k, v in results.items()}


# ----------------------------------------------------------------------------------------------- crash safety


def _child(inp: str, out: str, cache_dir: str) -> None:
    """Body of the crash-test subprocess: the same tiny model from the same seed, the same job."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # Pace the job so a fast machine cannot finish all 14 results between two kills (CI once did, leaving only two
    # kills): every result is still written by the real code path, then the child pauses before the next one.
    write = batch.ResultFile.write

    def paced(self, record):
        write(self, record)
        time.sleep(0.25)

    batch.ResultFile.write = paced
    batch.run_job(tiny_llm(), inp, out, batch_size=SLOTS, progress=False)


def _line_count(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume(clean, tmp_path):
    """Kill the job (SIGKILL) five times at random moments, resume each time: every id ends up in the output
    exactly once, with exactly the tokens of the uninterrupted run, and no line is ever torn or repeated."""
    inp, results = clean
    out = tmp_path / "out.jsonl"
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; import test_batch; "
            f"test_batch._child({inp!r}, {str(out)!r}, {str(tmp_path / 'jit-cache')!r})")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    rng = random.Random(1234)
    kills = 0
    for attempt in range(5):
        before = _line_count(out)
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
        if attempt == 0:
            time.sleep(rng.uniform(0.5, 3.0))  # anywhere from import to compile to decoding
        else:
            deadline = time.monotonic() + 120
            while _line_count(out) <= before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))  # somewhere after at least one new result
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGKILL), stderr.decode()[-2000:]
        if out.exists():  # complete lines are valid JSON with unique ids
            by_id(json.loads(x) for x in out.read_bytes().split(b"\n")[:-1])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert kills >= 3
    got = by_id(read_results(out))
    assert set(got) == set(results)
    for k, r in results.items():
        assert got[k]["token_ids"] == r["token_ids"] and got[k]["text"] == r["text"], k


def _child_code(fn: str, *args) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; import test_batch; "
            f"test_batch.{fn}({', '.join(repr(a) for a in args)})")


def _child_fsize(inp: str, out: str, limit: int) -> None:
    """A job under a file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG, as on a full disk); exits 2
    with the job's message on stderr, as the CLI does."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        batch.run_job(tiny_llm(), inp, out, batch_size=SLOTS, progress=False)
    except batch.BatchError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        sys.exit(2)


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_then_resume(clean, tmp_path):
    """SIGTERM after the first result: the job admits nothing new, writes the requests it was running, exits
    0 with whole lines only; a rerun serves the rest, every id exactly once with the uninterrupted tokens."""
    inp, results = clean
    out = tmp_path / "out.jsonl"
    code = _child_code("_child", inp, str(out), str(tmp_path / "jit-cache"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while _line_count(out) == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    at_signal = _line_count(out)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert "SIGTERM: finishing the requests in flight" in stderr.decode()
    lines = out.read_bytes()
    assert lines.endswith(b"\n")
    first = by_id(json.loads(x) for x in lines.split(b"\n")[:-1])
    # Stopped early: at most the slots that were running (and what finished meanwhile) came after the signal.
    assert at_signal <= len(first) <= at_signal + SLOTS + 1 and len(first) < len(results), (at_signal, len(first))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    got = by_id(read_results(out))
    assert set(got) == set(results)
    for k, r in results.items():
        assert got[k]["token_ids"] == r["token_ids"], k


@pytest.mark.slow
def test_full_disk_stops_cleanly_and_resume_recovers_everything(clean, tmp_path):
    """Writes past a file-size limit fail: the job ends with one clear message (no traceback), the output holds
    whole lines only, and a rerun without the limit completes every id exactly once."""
    inp, results = clean
    out = tmp_path / "out.jsonl"
    one_line = len(json.dumps(next(iter(results.values())))) + 1
    limit = 3 * one_line + one_line // 2  # room for about three results
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPECJAX_COMPILATION_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", _child_code("_child_fsize", inp, str(out), limit)], env=env,
                          capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err[-2000:]
    assert "cannot write the result of id" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
    data = out.read_bytes()
    assert data.endswith(b"\n") and 1 <= data.count(b"\n") <= 4 and len(data) <= limit
    proc = subprocess.run([sys.executable, "-c", _child_code("_child", inp, str(out), str(tmp_path / "jc"))],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    got = by_id(read_results(out))
    assert set(got) == set(results)
    for k, r in results.items():
        assert got[k]["token_ids"] == r["token_ids"], k


def test_ngram_job_backs_off_against_the_break_even_measured_at_its_batch_size(llm, clean, tmp_path, monkeypatch):
    """The slot loop's back-off uses a break-even measured at the job's batch size (a verify over B rows costs
    more plain steps than at batch 1): measured once before the first request, kept per (config, B), handed to
    every loop call, and it decides: a floor no gain reaches leaves only probes, a floor of zero speculates."""
    from specjax import backoff
    from specjax.config import SpeculativeConfig

    inp, results = clean
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    key = (SpeculativeConfig.from_user(spec), SLOTS)
    saved = dict(llm.runtime.break_even)
    measured, floors = [], []
    real_calibrate = backoff.calibrate

    def spy_calibrate(*a, **k):
        out = real_calibrate(*a, **k)
        measured.append(out[1])
        return out

    from specjax.runners import speculative
    monkeypatch.setattr(speculative, "calibrate", spy_calibrate)
    real_until = speculative.SpecVariant.until_free

    def spy_until(self, b, state, sampling, max_steps, min_gain=None, force=False):
        if min_gain is None or abs(min_gain) < 1e8:  # not one of calibrate's forced chunks
            floors.append(min_gain)
        return real_until(self, b, state, sampling, max_steps, min_gain, force)

    monkeypatch.setattr(speculative.SpecVariant, "until_free", spy_until)
    try:
        llm.runtime.break_even.pop(key, None)
        job(llm, inp, tmp_path / "a.jsonl", speculative=spec)
        assert len(measured) == 1 and measured[0] is not None and key in llm.runtime.break_even
        assert floors and set(floors) == {llm.runtime.break_even[key]}
        job(llm, inp, tmp_path / "b.jsonl", speculative=spec)
        assert len(measured) == 1  # kept: the second job of the same shape does not measure again

        def verify_steps(floor, name):
            llm.runtime.break_even[key] = floor
            s, _ = job(llm, inp, tmp_path / name, speculative=spec)
            got = by_id(read_results(tmp_path / name))
            assert {k: v["token_ids"] for k, v in got.items()} == {k: v["token_ids"] for k, v in results.items()}
            return s.verify_steps

        assert verify_steps(1e9, "never.jsonl") < verify_steps(0.0, "always.jsonl")
    finally:
        llm.runtime.break_even.clear()
        llm.runtime.break_even.update(saved)
