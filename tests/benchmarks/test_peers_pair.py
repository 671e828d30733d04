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

# Recorded from llama.cpp's own tools built from the source vendored in llama-cpp-python 0.3.36 (commit 0c1e570),
# Qwen2.5-Coder-0.5B on a 9-token ChatML prompt on a busy machine (the numbers are not figures), logger prefixes kept.
SPEC_TAIL = """\
0.44.917.286 I encoded    9 tokens in    4.284 seconds, speed:    2.101 t/s
0.44.917.288 I decoded   10 tokens in   24.483 seconds, speed:    0.408 t/s
0.44.917.288 I 
0.44.917.288 I n_draft   = 3
0.44.917.289 I n_predict = 10
0.44.917.289 I n_drafted = 5
0.44.917.289 I n_accept  = 5
0.44.917.290 I accept    = 100.000%
"""

PERF_TAIL = """\
0.21.781.187 I common_perf_print:    sampling time =       1.24 ms
0.21.781.210 I common_perf_print:    samplers time =       0.36 ms /    13 tokens
0.21.781.232 I common_perf_print:        load time =    9884.45 ms
0.21.781.247 I common_perf_print: prompt eval time =    4350.28 ms /     9 tokens (  483.36 ms per token,     2.07 tokens per second)
0.21.781.261 I common_perf_print:        eval time =    5602.78 ms /     3 runs   ( 1867.59 ms per token,     0.54 tokens per second)
0.21.781.275 I common_perf_print:       total time =    9955.26 ms /    12 tokens
0.21.781.288 I common_perf_print: unaccounted time =       0.96 ms /   0.0 %      (total - sampling - prompt eval - eval) / (total)
0.21.781.344 I common_perf_print:    graphs reused =          2
"""

VERBOSE_PROMPT = """\
'
0.11.826.271 I llama_completion: number of tokens in prompt = 9
0.11.826.286 I 151644 -> '<|im_start|>'
0.11.826.299 I    872 -> 'user'
0.11.826.313 I    198 -> '
'
0.11.826.326 I   6023 -> 'hi'
0.11.826.339 I 151645 -> '<|im_end|>'
0.11.826.352 I    198 -> '
'
0.11.826.365 I 151644 -> '<|im_start|>'
0.11.826.379 I  77091 -> 'assistant'
0.11.826.391 I    198 -> '
'
0.11.826.404 I 
0.11.826.424 I sampler seed: 2369185234
"""


def test_parse_speculative_reads_every_number():
    r = pp.parse_speculative(SPEC_TAIL)
    assert r == {"encoded_tokens": 9, "encoded_seconds": 4.284, "encoded_tps": 2.101, "decoded_tokens": 10,
                 "decoded_seconds": 24.483, "decoded_tps": 0.408, "n_draft": 3, "n_predict": 10, "n_drafted": 5,
                 "n_accept": 5, "accept_pct": 100.0}


def test_parse_speculative_of_a_crash_is_empty():
    assert pp.parse_speculative("llama_model_load: error loading model\nSegmentation fault\n") == {}


def test_parse_perf_separates_prompt_eval_from_eval():
    r = pp.parse_perf(PERF_TAIL)
    assert (r["prompt_ms"], r["prompt_tokens"], r["prompt_tps"]) == (4350.28, 9, 2.07)
    assert (r["eval_ms"], r["eval_tokens"], r["eval_tps"]) == (5602.78, 3, 0.54)


def test_parse_verbose_prompt_ids_under_the_logger_prefix():
    assert pp.parse_verbose_prompt(VERBOSE_PROMPT) == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def test_same_greedy_text_allows_overshoot_and_trailing_blank_lines_only():
    assert pp.same_greedy_text("# Hello! How\n", "# Hello! How can I assist you today?\n\n\n\n")
    assert not pp.same_greedy_text("# Hello! Who", "# Hello! How can I")
    assert not pp.same_greedy_text(None, "x")


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
