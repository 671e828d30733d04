"""benchmarks/peers_pair.py: its parsers on output recorded from llama.cpp's own tools, and the committed prompt sets."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location("peers_pair", os.path.join(ROOT, "benchmarks", "peers_pair.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


pp = _load()

# Recorded from llama-speculative-simple built from llama-cpp-python 0.3.36's vendored llama.cpp (commit 0c1e570).
SPEC_TAIL = """
encoded   47 tokens in    1.093 seconds, speed:   43.001 t/s
decoded    9 tokens in    2.617 seconds, speed:    3.439 t/s

n_draft   = 5
n_predict = 9
n_drafted = 10
n_accept  = 6
accept    = 60.000%

draft:
"""

PERF_TAIL = """
common_perf_print:    sampling time =       0.61 ms
common_perf_print:    samplers time =       0.34 ms /    55 tokens
common_perf_print:        load time =    1480.10 ms
common_perf_print: prompt eval time =    1138.91 ms /    47 tokens (   24.23 ms per token,    41.27 tokens per second)
common_perf_print:        eval time =    2330.54 ms /     7 runs   (  332.93 ms per token,     3.00 tokens per second)
common_perf_print:       total time =    3484.77 ms /    54 tokens
"""


def test_parse_speculative_reads_every_number():
    r = pp.parse_speculative(SPEC_TAIL)
    assert r == {"encoded_tokens": 47, "encoded_seconds": 1.093, "encoded_tps": 43.001, "decoded_tokens": 9,
                 "decoded_seconds": 2.617, "decoded_tps": 3.439, "n_draft": 5, "n_predict": 9, "n_drafted": 10,
                 "n_accept": 6, "accept_pct": 60.0}


def test_parse_speculative_of_a_crash_is_empty():
    assert pp.parse_speculative("llama_model_load: error loading model\nSegmentation fault\n") == {}


def test_parse_perf_separates_prompt_eval_from_eval():
    r = pp.parse_perf(PERF_TAIL)
    assert (r["prompt_ms"], r["prompt_tokens"], r["prompt_tps"]) == (1138.91, 47, 41.27)
    assert (r["eval_ms"], r["eval_tokens"], r["eval_tps"]) == (2330.54, 7, 3.00)


def test_parse_llama_bench_and_batched_bench_jsonl():
    bench = ('{"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "qwen2 1.5B Q4_K - Medium", '
             '"n_threads": 2, "repack": false, "n_prompt": 0, "n_gen": 16, "avg_ts": 12.5, "stddev_ts": 0.1, '
             '"samples_ts": [12.4, 12.6]}\nnoise\n')
    rows = pp.parse_llama_bench_jsonl(bench)
    assert rows == [{"n_prompt": 0, "n_gen": 16, "n_threads": 2, "repack": False, "avg_ts": 12.5, "stddev_ts": 0.1,
                     "samples_ts": [12.4, 12.6], "model_type": "qwen2 1.5B Q4_K - Medium",
                     "build_commit": "0c1e570", "cpu_info": "AMD EPYC"}]
    batched = ('main: n_kv_max = 2048\n{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, '
               '"is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, '
               '"pl": 4, "n_kv": 96, "t_pp": 1.5, "speed_pp": 42.6, "t_tg": 2.0, "speed_tg": 16.0, "t": 3.5, '
               '"speed": 27.4}\n')
    (b,) = pp.parse_batched_bench_jsonl(batched)
    assert (b["pl"], b["speed_tg"], b["speed_pp"]) == (4, 16.0, 42.6)


def test_parse_verbose_prompt_ids():
    text = ("prompt: '<|im_start|>system'\nnumber of tokens in prompt = 3\n151644 -> '<|im_start|>'\n"
            "  8948 -> 'system'\n   198 -> '\n'\n\n  42 -> 'x'\n")
    assert pp.parse_verbose_prompt(text) == [151644, 8948, 198]


def test_aggregate_is_tokens_over_seconds_of_the_runs_that_worked():
    recs = [{"ok": True, "n": 10, "s": 2.0}, {"ok": True, "n": 30, "s": 2.0}, {"ok": False}]
    a = pp.aggregate(recs, "n", "s")
    assert (a["prompts"], a["ok"], a["tokens"], a["tps"]) == (3, 2, 40, 10.0)


def test_missing_binary_is_a_one_line_error(tmp_path):
    with pytest.raises(pp.PairBenchError, match="llama-bench not found"):
        pp.find_bin(str(tmp_path), "llama-bench")


def test_prompt_file_keeps_the_trailing_newline_llama_cpp_drops(tmp_path):
    ll = pp.LlamaCpp.__new__(pp.LlamaCpp)
    ll.workdir = str(tmp_path)
    p = pp.Prompt("a", "python", "x", "set", "<|im_start|>assistant\n")
    with open(ll.prompt_file(p), encoding="utf-8", newline="") as f:
        assert f.read() == p.text + "\n"


@pytest.mark.parametrize("name", ["code_generation", "code_editing"])
def test_prompt_sets_are_well_formed(name):
    path = os.path.join(ROOT, "benchmarks", "prompts", f"{name}.jsonl")
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    assert 12 <= len(rows) <= 20
    assert all(set(r) == {"id", "category", "prompt"} for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    if name == "code_editing":
        for r in rows:  # an edit quotes the code it asks back: one fenced block of 20-60 lines
            blocks = re.findall(r"```\w*\n(.*?)\n```", r["prompt"], re.S)
            assert len(blocks) == 1, r["id"]
            assert 20 <= blocks[0].count("\n") + 1 <= 60, r["id"]


def test_prompt_sets_do_not_overlap_spec_bench():
    sb = "/work/shared/data/spec_bench/question.jsonl"
    if not os.path.exists(sb):
        pytest.skip("Spec-Bench questions not on this machine")
    spec = {t for line in open(sb, encoding="utf-8") for t in json.loads(line)["turns"]}
    for name in ("code_generation", "code_editing"):
        path = os.path.join(ROOT, "benchmarks", "prompts", f"{name}.jsonl")
        assert not {json.loads(line)["prompt"] for line in open(path, encoding="utf-8")} & spec
