"""`specjax bench`: dataset parsing, the summary arithmetic, the throughput and profile runs, lossy labelling and
the CLI end to end.

The model tests share one tiny random Llama written as a Hugging Face directory with a byte-level tokenizer
(hidden 64, 2 layers), so `LLM(model=dir)` and the CLI load the same weights and reuse each other's compiled
programs. Prompts are short and repetitive (n-gram drafts find matches) and generations 8 tokens long.
"""
from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax.config import SamplingParams, SpeculativeConfig, to_dict
from specjax.tools import bench, report

MAX_NEW = 8
PROMPTS = ["abcabcabc abc", "the cat the cat the", "1 2 3 1 2 3 1"]


# ------------------------------------------------------------------------------------------------ datasets
def write(path, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def test_spec_bench_format_keeps_ids_categories_and_turns(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "writing", "turns": ["Write a song."]},
            {"question_id": 91, "category": "math", "turns": ["1 + 1?"]}]
    path = write(tmp_path / "question.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = bench.load_prompts(path)
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("81", "writing", ("Write a poem.", "Shorter.")), ("82", "writing", ("Write a song.",)),
        ("91", "math", ("1 + 1?",))]
    assert [p.id for p in bench.load_prompts(path, per_category=1)] == ["81", "91"]
    assert [p.id for p in bench.load_prompts(path, limit=2)] == ["81", "82"]


def test_prompt_and_messages_jsonl_and_text_files(tmp_path):
    rows = [{"prompt": "hi"}, {"id": "m", "messages": [{"role": "system", "content": "s"},
                                                        {"role": "user", "content": "q1"},
                                                        {"role": "assistant", "content": "a"},
                                                        {"role": "user", "content": "q2"}]}]
    prompts = bench.load_prompts(write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows)))
    assert [(p.id, p.category, p.turns) for p in prompts] == [("1", "all", ("hi",)), ("m", "all", ("q1", "q2"))]
    text = bench.load_prompts(write(tmp_path / "p.txt", "first\n\nthird line\n"))
    assert [(p.id, p.category, p.turns) for p in text] == [("1", "text", ("first",)), ("3", "text", ("third line",))]


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ('{"question": "x"}', "unknown format"),
    ('{"turns": []}', "empty or non-text turns"),
    ('{"turns": ["ok", 3]}', "empty or non-text turns"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, problem):
    path = write(tmp_path / "bad.jsonl", '{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(bench.DatasetError, match=rf"bad\.jsonl:3: {problem}"):
        bench.load_prompts(path)


def test_missing_dataset_is_a_dataset_error(tmp_path):
    with pytest.raises(bench.DatasetError, match="does not exist"):
        bench.load_prompts(str(tmp_path / "nope.jsonl"))


# ------------------------------------------------------------------------------------------------ arithmetic
def record(category, new_tokens, time, ttft, drafted=0, accepted=0, forwards=0, pos_num=None, pos_den=None,
           verify_steps=None):
    """A `run_requests` record; `forwards` are decoding forwards (verify + plain steps), all verify steps unless
    `verify_steps` says fewer."""
    rec = {"id": category, "category": category, "new_tokens": new_tokens, "time": time, "ttft": ttft,
           "wall_time": 2 * time, "drafted": drafted, "accepted": accepted,
           "verify_steps": forwards if verify_steps is None else verify_steps, "target_forwards": forwards,
           "token_ids": [[]]}
    if pos_num is not None:
        rec["pos_num"], rec["pos_den"] = np.asarray(pos_num), np.asarray(pos_den)
    return rec


def test_summary_arithmetic_on_hand_made_records():
    results = {
        "plain": [record("a", 10, 1.0, 0.1), record("b", 30, 1.0, 0.3)],
        "ngram(k=2)": [record("a", 10, 0.5, 0.1, drafted=8, accepted=4, forwards=6, pos_num=[3, 1], pos_den=[4, 4],
                              verify_steps=4),
                       record("b", 30, 0.5, 0.1, drafted=12, accepted=9, forwards=20, pos_num=[5, 4],
                              pos_den=[6, 6], verify_steps=6)],
    }
    s = bench.summarize(results)
    plain, spec = s["plain"]["overall"], s["ngram(k=2)"]["overall"]
    assert plain["tokens_per_s"] == pytest.approx(20.0)
    assert spec["tokens_per_s"] == pytest.approx(40.0)
    assert spec["speedup"] == pytest.approx(2.0)
    assert s["ngram(k=2)"]["a"]["speedup"] == pytest.approx((10 / 0.5) / (10 / 1.0))
    assert spec["acceptance_rate"] == pytest.approx(13 / 20)
    assert spec["tau"] == pytest.approx(1 + 13 / 10)  # 1 + accepted / verify steps
    assert spec["tokens_per_forward"] == pytest.approx((13 + 26) / 26)  # (accepted + forwards) / forwards
    assert s["ngram(k=2)"]["b"]["tau"] == pytest.approx(1 + 9 / 6)
    assert s["ngram(k=2)"]["b"]["tokens_per_forward"] == pytest.approx((9 + 20) / 20)
    assert spec["per_position"] == pytest.approx([8 / 10, 5 / 10])
    assert plain["ttft_ms_p50"] == pytest.approx(200.0)
    assert "tau" not in plain and "tokens_per_forward" not in plain and plain["lossy"] is False
    md = report.markdown(s, "T=0")
    assert "| ngram(k=2) | 0.80 | 0.50 |" in md  # per-position row per method
    assert "| method | α | τ | tok/fwd |" in md and "| ngram(k=2) | 0.65 | 2.30 | 1.50 |" in md  # a column each
    assert "τ 2.50, 1.45 tok/fwd" in md  # category b: 1 + 9 / 6 and 29 / 20 in its cell
    one = bench.batch1_figures(results["ngram(k=2)"])  # the batch-1 throughput point runs on wall time
    assert one["tokens_per_s"] == pytest.approx(40 / 2.0) and one["tau"] == pytest.approx(spec["tau"])
    assert one["tokens_per_forward"] == pytest.approx(spec["tokens_per_forward"])


def pinned_figures(f: dict) -> None:
    """The figures of one record with 4 drafted and 4 accepted in 1 verify step, then 26 plain steps."""
    assert f["tau"] == pytest.approx(5.0)  # 1 + 4 / 1: plain steps are not verify steps
    assert f["tokens_per_forward"] == pytest.approx(31 / 27)  # (4 + 27) / 27 decoding forwards


def test_tau_counts_verify_steps_and_tokens_per_forward_counts_plain_steps_too():
    """The issue's example, through `aggregate` and `throughput_figures`; with the two figures swapped (the old
    tau, tokens per forward, in the tau field) the same check fails."""
    rec = record("a", 31, 1.0, 0.1, drafted=4, accepted=4, forwards=27, pos_num=[1, 1, 1, 1], pos_den=[1, 1, 1, 1],
                 verify_steps=1)
    agg = bench.aggregate([rec])
    pinned_figures(agg)
    m = types.SimpleNamespace(new_tokens=31, drafted=4, accepted=4, verify_steps=1, target_forwards=28, lossy=False)
    pinned_figures(bench.throughput_figures([m], wall=1.0, batch=1, calls=1))  # target_forwards has the prefill
    with pytest.raises(AssertionError):
        pinned_figures(dict(agg, tau=agg["tokens_per_forward"], tokens_per_forward=agg["tau"]))
    none = bench.aggregate([record("a", 27, 1.0, 0.1, drafted=0, accepted=0, forwards=27, pos_num=[0], pos_den=[0],
                                   verify_steps=0)])
    assert none["tau"] == 1.0 and none["tokens_per_forward"] == 1.0  # no verify step: nothing to average


def test_throughput_and_profile_figures():
    m = lambda new, drafted, accepted, fwd, lossy=False, verify=None: types.SimpleNamespace(
        new_tokens=new, drafted=drafted, accepted=accepted, target_forwards=fwd, lossy=lossy,
        verify_steps=fwd - 1 if verify is None else verify)
    f = bench.throughput_figures([m(8, 6, 3, 4, verify=2), m(8, 10, 5, 6, verify=3)], wall=0.5, batch=2, calls=1)
    assert f["tokens_per_s"] == pytest.approx(32.0)
    assert f["acceptance_rate"] == pytest.approx(8 / 16)
    assert f["tau"] == pytest.approx(1 + 8 / 5)  # per verify step
    assert f["tokens_per_forward"] == pytest.approx((8 + 8) / 8)  # forwards exclude each request's prefill
    md = report.throughput_markdown({"ngram": {"2": f}}, "T=0")
    assert "τ 2.60, 2.00 tok/fwd" in md and report.TAU_NOTE in md
    assert f["lossy"] is False
    assert bench.throughput_figures([m(8, 6, 3, 4, True)], 1.0, 2, 1)["lossy"] is True
    p = bench.profile_figures(draft=1.0, verify=3.0, steps=10, new_tokens=20, requests=2, lossy=False)
    assert p["draft_share"] == pytest.approx(0.25)
    assert p["verify_ms_per_step"] == pytest.approx(300.0)


def test_greedy_equal_compares_first_turns():
    recs = [{"token_ids": [[1, 2], [9]]}, {"token_ids": [[3]]}]
    assert bench.greedy_equal(recs, [[1, 2], [3]])
    assert not bench.greedy_equal(recs, [[1, 2], [4]])
    with pytest.raises(ValueError, match="batch-1 records"):
        bench.greedy_equal(recs, [[1, 2]])


# ------------------------------------------------------------------------------------------------ lossy labels
def lossy_yaml(tmp_path) -> str:
    return write(tmp_path / "lossy.yaml", "speculative:\n  method: ngram\n  num_speculative_tokens: 3\n"
                                          "  acceptance: typical\n")


def test_lossy_configs_are_labelled_and_recorded(tmp_path):
    label, spec = bench.method_from_name(lossy_yaml(tmp_path))
    assert label == "ngram(k=3) LOSSY" and spec.is_lossy
    info = bench.method_info("lossy.yaml", spec)
    assert info["lossy"] is True and info["config"] == to_dict(spec)
    assert info["config"]["acceptance"] == "typical"
    label, spec = bench.method_from_name("ngram")
    assert "LOSSY" not in label and bench.method_info("ngram", spec)["lossy"] is False
    assert bench.method_from_name("plain") == ("plain", None)
    assert bench.method_from_name("eagle3_lookup")[0] == "eagle3(tree 4x4, 12 nodes, +lookup 6)"
    rec = record("a", 4, 1.0, 0.1, 4, 2, 3, [2], [4])
    summary = bench.summarize({"plain": [record("a", 4, 1.0, 0.1)], "ngram(k=3) LOSSY": [dict(rec, lossy=True)]})
    assert summary["ngram(k=3) LOSSY"]["overall"]["lossy"] is True
    assert "LOSSY: typical acceptance" in report.markdown(summary, "T=0")


# ------------------------------------------------------------------------------------------------ tiny model
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = tiny_config(architecture="LlamaForCausalLM")  # the name config.json carries
    return save_hf_model(tmp_path_factory.mktemp("bench-tiny") / "model", cfg, tiny_params(cfg, seed=3))


@pytest.fixture(scope="module")
def llm(model_dir):
    from specjax.api import LLM

    return LLM(model_dir)


@pytest.fixture(scope="module")
def prompts():
    return [bench.BenchPrompt(str(i), "c", (t,)) for i, t in enumerate(PROMPTS)]


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# The packaged ngram config, the one `--methods ngram` loads: the CLI test then reuses these compilations.
NGRAM = bench.method_from_name("ngram")[1]


# ngram at batch 2 compiles two more programs (~17 s); the fast set checks batch 2 on plain decoding only.
@pytest.mark.parametrize("spec", [None, pytest.param(NGRAM, marks=pytest.mark.slow)], ids=["plain", "ngram"])
def test_batch_2_greedy_equals_batch_1(llm, prompts, spec):
    one = bench.run_requests(llm, prompts, spec, GREEDY)
    fig, token_ids = bench.run_throughput(llm, prompts, spec, GREEDY, 2)
    assert [len(t) for t in token_ids] == [MAX_NEW] * len(prompts)
    assert bench.greedy_equal(one, token_ids)
    assert fig["calls"] == 2 and fig["effective_batch"] == 2
    assert fig["requests"] == 3 and fig["new_tokens"] == 3 * MAX_NEW
    assert fig["tokens_per_s"] == pytest.approx(fig["new_tokens"] / fig["time_s"])
    assert ("tau" in fig) == (spec is not None)
    if spec is not None:
        assert 0.0 <= fig["acceptance_rate"] <= 1.0 and fig["tau"] >= fig["tokens_per_forward"] >= 1.0


def test_reps_start_from_the_same_learned_state(llm, prompts):
    """A repeated request must not find its own answer in the suffix drafter's global index: with the LLM handed
    to `_fastest`, every repetition accepts exactly what the first did. Without it (the planted leak) the repeat
    replays the first run's output and accepts more."""
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, adaptive=False)
    prompt = PROMPTS[1]
    accepted = []

    def call():
        o = llm.generate([prompt], GREEDY, spec)[0]
        accepted.append(o.metrics.accepted)
        return o

    llm.runtime.suffix_global = None
    bench._fastest(call, 3, llm)
    assert len(set(accepted)) == 1, accepted
    llm.runtime.suffix_global = None
    accepted.clear()
    bench._fastest(call, 2)
    assert accepted[1] > accepted[0], accepted


def test_reps_keep_the_fastest_run(llm, prompts, monkeypatch):
    """With reps, every timed generation runs that many times and the fastest wall time is the one kept."""
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 29.0])  # runs of 5 s, 2 s, 9 s
    calls = []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    assert bench._fastest(lambda: calls.append(1) or len(calls), 3) == (2.0, 2) and len(calls) == 3
    monkeypatch.undo()
    fig, token_ids = bench.run_throughput(llm, prompts[:2], None, GREEDY, 2, reps=2)
    assert fig["calls"] == 1 and [len(t) for t in token_ids] == [MAX_NEW] * 2


def test_profile_splits_draft_and_verify_time(llm, prompts):
    p = bench.run_profile(llm, prompts[:2], NGRAM, GREEDY)
    assert p["requests"] == 2 and p["new_tokens"] == 2 * MAX_NEW
    assert p["draft_s"] > 0 and p["verify_s"] > 0 and 0 < p["draft_share"] < 1
    # at most one host step per new token, at least one per (gamma + 1) tokens
    assert 2 * MAX_NEW / (NGRAM.num_speculative_tokens + 1) <= p["steps"] <= 2 * MAX_NEW
    assert p["verify_ms_per_step"] == pytest.approx(1000 * p["verify_s"] / p["steps"])


def run_cli(model_dir, tmp_path, methods: list[str], limit: int = 3) -> tuple[dict, str]:
    """`specjax bench` on the first `limit` prompts at T=0, batch sizes 1 and 2, one profiled prompt:
    (JSON, Markdown)."""
    import matplotlib

    matplotlib.use("Agg")
    from specjax.cli.main import main

    data = write(tmp_path / "q.jsonl", "\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]})
                                                  for i, (c, t) in enumerate(zip("xxy", PROMPTS))))
    out = tmp_path / "out"
    assert main(["bench", "--dataset", data, "--model", model_dir, "--methods", *methods, "-n", str(MAX_NEW),
                 "--temperatures", "0", "--batch-sizes", "1", "2", "--profile-prompts", "1", "--limit", str(limit),
                 "--out", str(out)]) == 0
    for png in ("T0_throughput.png", "T0_speedup.png", "T0_acceptance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not (out / "results.partial.json").exists()  # a finished run leaves only its final results
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_cli_writes_json_markdown_and_png(model_dir, llm, tmp_path):
    # One prompt: its "batch 2" run is one call of one request, so the CLI compiles nothing the model tests
    # (which `llm` orders first) have not; batch 2 proper is test_batch_2_greedy_equals_batch_1.
    report, md = run_cli(model_dir, tmp_path, ["ngram"], limit=1)
    env = report["environment"]
    assert env["model"] == model_dir and env["dtype"] == "float32" and env["backend"] == "auto"
    assert env["machine"] and env["specjax"]
    methods = report["methods"]
    assert list(methods) == ["plain", "ngram(k=4)"]  # plain is added as the baseline
    assert methods["ngram(k=4)"] == {"name": "ngram", "lossy": False, "config": to_dict(NGRAM)}
    assert methods["plain"]["config"] is None
    tp = report["throughput"]["0.0"]
    assert set(tp) == set(methods) and all(set(per) == {"1", "2"} for per in tp.values())
    for m in methods:
        assert tp[m]["2"]["greedy_equal_to_batch1"] is True
        assert tp[m]["2"]["effective_batch"] == 1 and tp[m]["2"]["tokens_per_s"] > 0
    assert "tau" in tp["ngram(k=4)"]["2"] and "tau" not in tp["plain"]["2"]
    prof = report["profile"]["0.0"]
    assert set(prof) == {"ngram(k=4)"} and prof["ngram(k=4)"]["requests"] == 1
    assert prof["ngram(k=4)"]["verify_s"] > 0
    assert set(report["runs"]["0.0"]["summary"]["plain"]) == {"x", "overall"}
    for text in ("tokens/s against batch size", "draft vs verify time", "Per-position acceptance",
                 "| ngram(k=4) | ", "T0_throughput.png"):
        assert text in md
    assert "LOSSY" not in md


@pytest.mark.slow
def test_cli_labels_lossy_config_everywhere(model_dir, tmp_path):
    report, md = run_cli(model_dir, tmp_path, ["plain", lossy_yaml(tmp_path)])
    label = "ngram(k=3) LOSSY"
    assert report["methods"][label]["lossy"] is True
    assert report["methods"][label]["config"]["acceptance"] == "typical"
    assert report["runs"]["0.0"]["summary"][label]["overall"]["lossy"] is True
    assert report["throughput"]["0.0"][label]["2"]["lossy"] is True
    assert report["throughput"]["0.0"]["plain"]["2"]["greedy_equal_to_batch1"] is True
    assert report["profile"]["0.0"][label]["lossy"] is True
    assert f"| {label} |" in md and "LOSSY: typical acceptance" in md


@pytest.mark.parametrize("flag, value", [("--batch-sizes", "0"), ("--batch-sizes", "two"), ("--profile-prompts", "-1")])
def test_bad_counts_are_refused_before_any_work(tmp_path, capsys, flag, value):
    from specjax.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "--dataset", str(tmp_path / "never-read.jsonl"), flag, value])
    assert f"argument {flag}" in capsys.readouterr().err


def test_plain_runs_first_and_a_later_plain_runs_again_as_a_drift_check():
    from specjax.cli.bench import _methods

    labels = [m[0] for m in _methods(["ngram", "plain", "medusa", "plain"])]
    assert labels == ["plain", "ngram(k=4)", "medusa(15 nodes)", "plain#2"]
    assert [m[0] for m in _methods(["ngram"])] == ["plain", "ngram(k=4)"]


def test_tree_methods_are_labelled_by_their_shape():
    """Tree and chain forms of one head get distinct labels naming the shape (side-by-side tables)."""
    assert bench.method_from_name("eagle")[0] == "eagle(tree 4x4, 12 nodes)"
    assert bench.method_from_name("eagle3")[0] == "eagle3(chain 4)"  # the shipped EAGLE-3 shape on CPU
    assert bench.method_from_name("medusa_chain")[0] == "medusa(chain 4)"
    assert bench.method_from_name("medusa_typical")[0] == "medusa(15 nodes) LOSSY"
    assert bench.method_from_name("ngram")[0] == "ngram(k=4)"


# ------------------------------------------------------------------------------------------------ peers
PEER_PROMPTS = [bench.BenchPrompt("1", "qa", ("Hi?",)), bench.BenchPrompt("2", "math", ("1 + 1?",))]


@pytest.fixture
def child_command(monkeypatch):
    """child_command(code): make `run_isolated` start `python -c code` with the real child's arguments in
    sys.argv[1:], instead of a peer."""
    import sys

    from specjax.tools import peers

    real = peers._child_command

    def use(code: str) -> None:
        monkeypatch.setattr(peers, "_child_command", lambda *a: [sys.executable, "-c", code, *real(*a)[3:]])

    return use


def test_peer_child_round_trips_prompts_and_records(child_command):
    """The child reads the prompts file and writes one record per prompt; the parent returns them unchanged."""
    from specjax.tools import peers

    child_command(
        "import json, sys; a = sys.argv[1:]; p = json.load(open(a[a.index('--prompts') + 1]));"
        "json.dump([{'id': r['id'], 'turns': r['turns'], 'n': int(a[a.index('--max-new-tokens') + 1])} for r in p],"
        " open(a[a.index('--out') + 1], 'w'))")
    got = peers.run_isolated("llama.cpp", "smollm2-135m", PEER_PROMPTS, 7)
    assert got == [{"id": "1", "turns": ["Hi?"], "n": 7}, {"id": "2", "turns": ["1 + 1?"], "n": 7}]


def test_a_peer_that_dies_by_a_signal_is_a_clear_error(child_command):
    """A native crash (here SIGILL, what a llama.cpp built with AMX does on a VM that hides AMX) becomes PeerFailed
    naming the signal, the likely cause and the end of the child's output, instead of ending the bench."""
    from specjax.tools import peers

    child_command("import os, signal, sys; print('loading the model', file=sys.stderr, flush=True);"
                  "os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(peers.PeerFailed) as e:
        peers.run_isolated("llama.cpp", "smollm2-135m", PEER_PROMPTS, 4)
    msg = str(e.value)
    assert "crashed with SIGILL" in msg and "rebuild" in msg and "loading the model" in msg


@pytest.mark.parametrize("code, problem", [
    ("raise SystemExit(1)", "exit status 1"),
    ("pass", "without writing its records"),
    ("import json, sys; a = sys.argv[1:]; json.dump([{}], open(a[a.index('--out') + 1], 'w'))", "1 records for 2"),
])
def test_a_peer_that_fails_or_writes_nothing_is_a_clear_error(child_command, code, problem):
    from specjax.tools import peers

    child_command(code)
    with pytest.raises(peers.PeerFailed, match=problem):
        peers.run_isolated("transformers", "smollm2-135m", PEER_PROMPTS, 4)


def test_unknown_peer_is_reported_unavailable_by_the_real_child():
    """The real `python -m specjax.tools.peers` child: an unknown peer name comes back as PeerUnavailable with its list."""
    from specjax.tools import peers

    with pytest.raises(peers.PeerUnavailable, match="unknown peer 'vllm'; available: transformers"):
        peers.run_isolated("vllm", "smollm2-135m", PEER_PROMPTS, 4)


def test_bench_keeps_going_after_a_peer_crash(child_command, capsys, tmp_path):
    """`_run_peers`: the crashed peer is skipped with its reason, the records measured before it are kept, and the
    next peer still runs and is checkpointed."""
    from specjax.cli import bench as bench_cli

    child_command(
        "import json, os, signal, sys; a = sys.argv[1:]\n"
        "if a[a.index('--name') + 1] == 'llama.cpp': os.kill(os.getpid(), signal.SIGILL)\n"
        "p = json.load(open(a[a.index('--prompts') + 1]))\n"
        "json.dump([{'id': r['id'], 'token_ids': [[1, 2]]} for r in p], open(a[a.index('--out') + 1], 'w'))")
    results = {"plain": [{"id": "1"}, {"id": "2"}]}
    saved = []
    args = types.SimpleNamespace(peers=["llama.cpp", "transformers"], model="smollm2-135m", max_new_tokens=4,
                                 peer_draft=None)
    bench_cli._run_peers(args, PEER_PROMPTS, results, checkpoint=lambda: saved.append(sorted(results)))
    assert sorted(results) == ["peer:transformers", "plain"]
    assert saved == [["peer:transformers", "plain"]]
    assert "peer llama.cpp skipped: peer llama.cpp crashed with SIGILL" in capsys.readouterr().err


def test_a_run_that_dies_keeps_what_it_measured(model_dir, llm, tmp_path, monkeypatch):
    """The bench rewrites results.partial.json after every method: when a later stage dies (here the peers), the
    methods already measured are on disk."""
    from specjax.cli import bench as bench_cli
    from specjax.cli.main import main

    def die(*a, **k):
        raise RuntimeError("the machine went away")

    monkeypatch.setattr(bench_cli, "_run_peers", die)
    data = write(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "x", "turns": [PROMPTS[0]]}))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="went away"):
        main(["bench", "--dataset", data, "--model", model_dir, "--methods", "plain", "ngram", "-n", str(MAX_NEW),
              "--temperatures", "0", "--profile-prompts", "0", "--out", str(out)])
    assert not (out / "results.json").exists()
    kept = json.loads((out / "results.partial.json").read_text())
    records = kept["runs"]["0.0"]["records"]
    assert sorted(records) == ["ngram(k=4)", "plain"]
    assert records["ngram(k=4)"][0]["identical_to_plain"] is True and records["plain"][0]["new_tokens"] == MAX_NEW
