"""Peer engines on the Qwen2.5-Coder pair (1.5B target, 0.5B drafter): llama.cpp's own C++ tools and HF transformers.

    python benchmarks/peers_pair.py --llama-cpp-bin DIR [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--peers llama.cpp,hf] [--parts bench,batched,spec,plain] [--prompts FILE.jsonl ...] [--limit N]
        [--new-tokens 96] [--threads 2] [--json out.json]

The llama.cpp side runs the binaries of a build of llama.cpp (`--llama-cpp-bin` or $LLAMA_CPP_BIN: the directory that
holds llama-bench, llama-batched-bench, llama-completion and llama-speculative-simple), each in its own process, so a
crash (repacking has segfaulted on some CPUs) is recorded with its signal and the run goes on:

- bench:   `llama-bench` plain decode (tg N) and prompt processing (pp P), once per weight-repacking setting
           (`--repack 0` / `--repack 1`), for the target, the drafter and any `--bench-extra` file. The fastest
           setting that ran becomes each model's setting for the parts below (`-nr` / `--no-repack` where it is 0).
- batched: `llama-batched-bench` on the target, prompt P, N new tokens, `-npl` 1,4,8 parallel sequences.
- plain:   `llama-completion` greedy on every prompt (the baseline of the speculative part, and its text).
- spec:    `llama-speculative-simple` with the drafter, greedy, sweeping `--draft-max` x `--draft-p-min` on the first
           `--sweep-limit` prompts of each set, then the best setting of each set on all its prompts.
           Its own report (decoded tokens/s, n_drafted, n_accept, acceptance) is parsed.
- `--plain-last` runs llama-bench on the target again at the end (plain first and last).

The HF side (`--peers hf`, needs `pip install -e ".[parity]"`) loads both GGUF files with transformers (dequantized,
float32 by default) and times greedy `generate` plain, with `assistant_model=<drafter>`, and with
`prompt_lookup_num_tokens`, on the same prompts, torch limited to `--threads` threads.

Prompts are JSON lines {"id", "category", "prompt"} (benchmarks/prompts/code_generation.jsonl and
code_editing.jsonl by default). Each is wrapped once in the target's own chat template (the GGUF's
`tokenizer.chat_template`, rendered by specjax's template engine as transformers renders it) and that same text goes to
every engine: llama.cpp reads it raw (`-f`, special tokens parsed, conversation mode off, no BOS: the files do not ask
for one) and transformers tokenizes it without adding special tokens. `--check-tokens` asks llama-completion for the
prompt's token ids (`--verbose-prompt`) and compares them with specjax's tokenizer (and transformers' with `--peers
hf`).

The JSON output holds the CPU model (/proc/cpuinfo), the llama.cpp version and commit, every exact command line with
its exit status, and the parsed numbers. Figures belong in reports/ (see reports/pair_cpu/README.md), measured on a
quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = [os.path.join(ROOT, "benchmarks", "prompts", "code_generation.jsonl"),
                   os.path.join(ROOT, "benchmarks", "prompts", "code_editing.jsonl")]
TOOLS = ("llama-bench", "llama-batched-bench", "llama-completion", "llama-speculative-simple")


class PairBenchError(Exception):
    """A setup problem the script reports in one line (missing binary, model, prompt file)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    set: str        # the prompt file's stem, e.g. code_generation
    text: str       # the prompt wrapped in the chat template, as every engine sees it


# -- inputs ---------------------------------------------------------------------------------------------------------

def resolve_gguf(spec: str) -> str:
    """A model alias (through specjax's resolver) or a path -> the path of a .gguf file."""
    from specjax.errors import SpecjaxError
    from specjax.models.loading import resolve_model

    try:
        files = resolve_model(spec)
    except SpecjaxError as e:
        raise PairBenchError(f"model {spec!r}: {e}") from None
    if files.kind != "gguf":
        raise PairBenchError(f"model {spec!r} resolves to {files.path!r}, which is not a GGUF file; llama.cpp needs one")
    return files.path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU features that decide llama.cpp's and specjax's kernel paths (reports name them)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def load_prompts(paths: list[str], limit: int | None) -> list[tuple[str, str, str]]:
    """(set, id, category, prompt) rows of each JSONL file, the first `limit` of each."""
    rows = []
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path, encoding="utf-8") as f:
                lines = [ln for ln in f if ln.strip()]
        except OSError as e:
            raise PairBenchError(f"cannot read prompt file {path}: {e}") from None
        for n, line in enumerate(lines[:limit] if limit else lines, 1):
            try:
                r = json.loads(line)
                rows.append((name, str(r["id"]), str(r["category"]), str(r["prompt"])))
            except (ValueError, KeyError, TypeError) as e:
                raise PairBenchError(f"{path}:{n}: not a {{id, category, prompt}} JSON line ({e})") from None
    return rows


def wrap_prompts(rows, gguf_path: str) -> list[Prompt]:
    """Each prompt as one user turn in the model's chat template with the generation prompt added."""
    from specjax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path)
    return [Prompt(i, c, p, s, tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
            for s, i, c, p in rows]


# -- running a tool -------------------------------------------------------------------------------------------------

@dataclass
class Run:
    cmd: list[str]
    rc: int
    signal: str | None
    seconds: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def record(self) -> dict:
        tail = [ln for ln in self.stderr.replace("\r", "\n").splitlines() if ln.strip()][-8:]
        out = {"cmd": shlex.join(self.cmd), "rc": self.rc, "seconds": round(self.seconds, 3)}
        if self.signal:
            out["signal"] = self.signal
        if not self.ok:
            out["stderr_tail"] = tail
        return out


def run_tool(cmd: list[str], timeout: float) -> Run:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                           timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")) + \
            f"\n[timed out after {timeout:.0f} s]"
    sig = signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else None
    return Run(cmd, rc, sig, time.perf_counter() - t, out, err)


def find_bin(bindir: str, tool: str) -> str:
    path = os.path.join(bindir, tool)
    if not os.access(path, os.X_OK):
        raise PairBenchError(f"{tool} not found in {bindir}; build it (cmake --build build --target {tool}) or "
                             "point --llama-cpp-bin / $LLAMA_CPP_BIN at the directory holding it")
    return path


def llama_version(bindir: str) -> dict:
    """`llama-bench --version` (version, build number, commit, compiler)."""
    r = run_tool([find_bin(bindir, "llama-bench"), "--version"], 60)
    text = (r.stdout + r.stderr).strip()
    m = re.search(r"version:\s*(\S+)\s*\(build\s*(\d+),\s*commit\s*(\w+)\)", text)
    out = {"text": text}
    if m:
        out.update(version=m.group(1), build=int(m.group(2)), commit=m.group(3))
    return out


# -- parsers (each takes a tool's output text and returns numbers; tests feed them recorded text) -------------------

def parse_llama_bench_jsonl(text: str) -> list[dict]:
    """llama-bench `-o jsonl`: one object per test; keeps the fields the tables use."""
    keep = ("n_prompt", "n_gen", "n_threads", "repack", "avg_ts", "stddev_ts", "samples_ts", "model_type",
            "model_size", "build_commit", "cpu_info", "flash_attn", "n_batch", "n_ubatch")
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            rows.append({k: r[k] for k in keep if k in r})
    return rows


def parse_batched_bench_jsonl(text: str) -> list[dict]:
    """llama-batched-bench `--output-format jsonl`: pp, tg, pl (parallel sequences), speeds in tokens/s."""
    keep = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed", "n_threads")
    return [{k: r[k] for k in keep if k in r}
            for r in (json.loads(ln) for ln in text.splitlines() if ln.strip().startswith("{\"n_kv_max\""))]


_FLOAT = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf)"


def parse_speculative(text: str) -> dict:
    """llama-speculative-simple's summary: encoded/decoded tokens, seconds and t/s, n_drafted, n_accept, accept %."""
    out = {}
    for kind in ("encoded", "decoded"):
        m = re.search(rf"{kind}\s+(\d+) tokens in\s+{_FLOAT} seconds, speed:\s+{_FLOAT} t/s", text)
        if m:
            out[f"{kind}_tokens"] = int(m.group(1))
            out[f"{kind}_seconds"] = float(m.group(2))
            out[f"{kind}_tps"] = float(m.group(3))
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(rf"\b{key}\s*=\s*(-?\d+)", text)
        if m:
            out[key] = int(m.group(1))
    m = re.search(rf"\baccept\s*=\s*{_FLOAT}%", text)
    if m:
        out["accept_pct"] = float(m.group(1))
    return out


def parse_perf(text: str) -> dict:
    """llama-completion's perf lines: prompt eval and eval (generation) time, tokens and tokens/s."""
    out = {}
    for key, name in (("prompt eval time", "prompt"), ("eval time", "eval")):
        m = re.search(rf"(?<!prompt ){key}\s*=\s*{_FLOAT} ms /\s*(\d+) (?:tokens|runs)\s*\(\s*{_FLOAT} ms per token,"
                      rf"\s*{_FLOAT} tokens per second\)", text)
        if m:
            out[f"{name}_ms"] = float(m.group(1))
            out[f"{name}_tokens"] = int(m.group(2))
            out[f"{name}_tps"] = float(m.group(4))
    return out


def parse_verbose_prompt(text: str) -> list[int]:
    """The prompt token ids llama-completion prints with --verbose-prompt ('  1234 -> 'piece'' lines)."""
    m = re.search(r"number of tokens in prompt = (\d+)\n(.*)", text, re.S)
    if not m:
        return []
    n = int(m.group(1))
    # each line may carry the logger's prefix ("0.11.826.286 I ") before the id
    return [int(x) for x in re.findall(r"^(?:[\d.]+ [A-Z] )?\s*(\d+) -> '", m.group(2), re.M)[:n]]


def generated_text(stdout: str, prompt_text: str) -> str:
    """The text llama-speculative-simple printed after echoing the prompt (special tokens render as text)."""
    i = stdout.find(prompt_text)
    return stdout[i + len(prompt_text):] if i >= 0 else stdout


def same_greedy_text(a: str | None, b: str | None) -> bool:
    """Whether two greedy outputs agree. The tools stop at different lengths (a speculative step can overshoot -n by
    its accepted draft) and end their output with their own blank lines, so: the shorter, trailing whitespace
    stripped, is a prefix of the longer."""
    if a is None or b is None:
        return False
    a, b = a.rstrip(), b.rstrip()
    return a.startswith(b) if len(a) >= len(b) else b.startswith(a)


# -- the llama.cpp parts --------------------------------------------------------------------------------------------

class LlamaCpp:
    def __init__(self, bindir: str, threads: int, timeout: float, workdir: str):
        self.bindir, self.threads, self.timeout, self.workdir = bindir, threads, timeout, workdir
        self.tools = {t: find_bin(bindir, t) for t in TOOLS}
        self.repack: dict[str, int] = {}   # model path -> chosen repack setting (1 = llama.cpp's default)
        self.crashed: set[tuple[str, int]] = set()   # (model path, repack setting) that did not run
        self.commands: list[dict] = []

    def _run(self, cmd: list[str], what: str) -> Run:
        r = run_tool(cmd, self.timeout)
        rec = r.record()
        rec["what"] = what
        self.commands.append(rec)
        status = "ok" if r.ok else (r.signal or f"rc {r.rc}")
        print(f"  [{status}, {r.seconds:.1f} s] {what}", flush=True)
        return r

    def _repack_flags(self, model: str) -> list[str]:
        return [] if self.repack.get(model, 1) else ["--no-repack"]

    def prompt_file(self, p: Prompt) -> str:
        """The prompt text in a file for -f. llama.cpp's -f drops one trailing newline; ChatML's generation prompt ends
        in one, so the file carries one more to keep the text exact."""
        path = os.path.join(self.workdir, f"{p.set}.{p.id}.txt")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(p.text + "\n")
        return path

    def bench(self, models: dict[str, str], n_gen: int, n_prompt: int, reps: int, repacks: list[int]) -> list[dict]:
        """llama-bench per model and repack setting, each in its own process; a crash is a row with its signal."""
        rows = []
        for label, model in models.items():
            for rp in repacks:
                cmd = [self.tools["llama-bench"], "-m", model, "-t", str(self.threads), "-n", str(n_gen),
                       "-p", str(n_prompt), "-r", str(reps), "--repack", str(rp), "-o", "jsonl"]
                r = self._run(cmd, f"llama-bench {label} repack={rp}")
                row = {"model": label, "path": model, "repack": rp, "ok": r.ok, "rc": r.rc, "signal": r.signal,
                       "cmd": shlex.join(cmd)}
                if r.ok:
                    for t in parse_llama_bench_jsonl(r.stdout):
                        if t.get("n_gen"):
                            row["tg_tps"], row["tg_std"] = t["avg_ts"], t.get("stddev_ts")
                        elif t.get("n_prompt"):
                            row["pp_tps"], row["pp_std"] = t["avg_ts"], t.get("stddev_ts")
                        row.setdefault("model_type", t.get("model_type"))
                rows.append(row)
                if not r.ok:
                    self.crashed.add((model, rp))
            working = [r for r in rows if r["model"] == label and r["ok"] and "tg_tps" in r]
            if working:
                best = max(working, key=lambda r: r["tg_tps"])
                self.repack[model] = best["repack"]
                best["chosen"] = True
        return rows

    def batched(self, model: str, n_prompt: int, n_gen: int, npl: list[int]) -> dict:
        ctx = max(npl) * (n_prompt + n_gen) + 64
        cmd = [self.tools["llama-batched-bench"], "-m", model, "-t", str(self.threads), "-tb", str(self.threads),
               "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(n_prompt), "-ntg", str(n_gen),
               "-npl", ",".join(map(str, npl)), "--output-format", "jsonl", *self._repack_flags(model)]
        r = self._run(cmd, f"llama-batched-bench npl={','.join(map(str, npl))}")
        return {"cmd": shlex.join(cmd), "ok": r.ok, "rc": r.rc, "signal": r.signal,
                "rows": parse_batched_bench_jsonl(r.stdout + "\n" + r.stderr) if r.ok else []}

    def _common(self, model: str, n_new: int, ctx: int, repack: int | None = None) -> list[str]:
        rp = self.repack.get(model, 1) if repack is None else repack
        return ["-m", model, "-t", str(self.threads), "-tb", str(self.threads), "-c", str(ctx), "-n", str(n_new),
                "--temp", "0", "--seed", "0", *([] if rp else ["--no-repack"])]

    def plain(self, p: Prompt, model: str, n_new: int, ctx: int, verbose_prompt: bool = False) -> dict:
        cmd = [self.tools["llama-completion"], *self._common(model, n_new, ctx), "-f", self.prompt_file(p),
               "-no-cnv", "--no-display-prompt", "--perf"]
        if verbose_prompt:
            cmd.append("--verbose-prompt")
        r = self._run(cmd, f"llama-completion {p.set}/{p.id}")
        rec = {"id": p.id, "set": p.set, "category": p.category, "cmd": shlex.join(cmd), "ok": r.ok, "rc": r.rc,
               "signal": r.signal}
        if r.ok:
            rec.update(parse_perf(r.stderr + "\n" + r.stdout))
            rec["text"] = r.stdout
            if verbose_prompt:
                rec["prompt_ids"] = parse_verbose_prompt(r.stderr + "\n" + r.stdout)
        return rec

    def speculative(self, p: Prompt, target: str, draft: str, n_new: int, ctx: int, n_max: int,
                    p_min: float) -> dict:
        """One greedy speculative run. The drafter inherits the target's model options, the repack setting included
        (this llama.cpp has no draft-only repack flag), so the target's chosen setting holds for both."""
        rp = self.repack.get(target, 1)
        if (draft, rp) in self.crashed:
            rp = 1 - rp
        cmd = [self.tools["llama-speculative-simple"], *self._common(target, n_new, ctx, rp), "-md", draft,
               "-td", str(self.threads), "-tbd", str(self.threads), "--spec-type", "draft-simple",
               "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
               "-f", self.prompt_file(p)]
        r = self._run(cmd, f"llama-speculative-simple {p.set}/{p.id} n_max={n_max} p_min={p_min}")
        rec = {"id": p.id, "set": p.set, "category": p.category, "n_max": n_max, "p_min": p_min, "repack": rp,
               "cmd": shlex.join(cmd), "ok": r.ok, "rc": r.rc, "signal": r.signal}
        if r.ok:
            rec.update(parse_speculative(r.stderr + "\n" + r.stdout))
            rec["text"] = generated_text(r.stdout, p.text)
        return rec


def aggregate(recs: list[dict], tokens_key: str, seconds_key: str) -> dict:
    ok = [r for r in recs if r.get("ok") and r.get(seconds_key)]
    toks = sum(r[tokens_key] for r in ok)
    secs = sum(r[seconds_key] for r in ok)
    return {"prompts": len(recs), "ok": len(ok), "tokens": toks, "seconds": secs,
            "tps": toks / secs if secs else None}


def run_llama_cpp(args, target: str, draft: str, prompts: list[Prompt], out: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="peers-pair-") as tmp:
        ll = LlamaCpp(args.llama_cpp_bin, args.threads, args.tool_timeout, tmp)
        res: dict = {"version": llama_version(args.llama_cpp_bin), "bindir": os.path.abspath(args.llama_cpp_bin)}
        out["llama_cpp"] = res
        ctx = args.ctx
        models = {"target": target, "draft": draft, **{os.path.basename(x): x for x in args.bench_extra}}
        repacks = [0, 1] if args.repack == "both" else [int(args.repack)]
        if "bench" in args.parts:
            print("llama-bench (plain decode and prompt processing, per repack setting):", flush=True)
            res["bench"] = ll.bench(models, args.new_tokens, args.bench_prompt, args.reps, repacks)
        else:
            for m in (target, draft):
                ll.repack[m] = 1 if args.repack == "both" else int(args.repack)
        res["repack_chosen"] = {label: ll.repack.get(m) for label, m in models.items()}
        if "batched" in args.parts:
            print("llama-batched-bench (target):", flush=True)
            res["batched"] = ll.batched(target, args.bench_prompt, args.new_tokens, args.npl)
        if "plain" in args.parts or "spec" in args.parts:
            print("llama-completion (target, plain greedy, each prompt):", flush=True)
            plain = [ll.plain(p, target, args.new_tokens, ctx, verbose_prompt=args.check_tokens) for p in prompts]
            res["plain"] = plain
            res["plain_summary"] = {s: aggregate([r for r in plain if r["set"] == s], "eval_tokens", "eval_ms")
                                    for s in sets_of(prompts)}
            for s in res["plain_summary"].values():  # eval_ms -> tokens/s
                s["tps"] = s["tokens"] / (s["seconds"] / 1e3) if s["seconds"] else None
            if args.check_tokens:
                res["token_check"] = check_tokens(prompts, plain, target)
        if "spec" in args.parts:
            res["spec"] = run_spec_sweep(args, ll, prompts, target, draft, ctx, res.get("plain", []))
        if args.plain_last and "bench" in args.parts:
            print("llama-bench again (target, chosen repack; plain last):", flush=True)
            res["bench_last"] = ll.bench({"target": target}, args.new_tokens, args.bench_prompt, args.reps,
                                         [ll.repack.get(target, 1)])
        res["commands"] = ll.commands


def sets_of(prompts: list[Prompt]) -> list[str]:
    return list(dict.fromkeys(p.set for p in prompts))


def run_spec_sweep(args, ll: LlamaCpp, prompts, target, draft, ctx, plain) -> dict:
    out = {"sweep": [], "best": {}, "final": []}
    plain_by = {(r["set"], r["id"]): r for r in plain}
    for s in sets_of(prompts):
        ps = [p for p in prompts if p.set == s]
        sweep_ps = ps[:args.sweep_limit] if args.sweep_limit else ps
        print(f"llama-speculative-simple sweep on {s} ({len(sweep_ps)} prompts):", flush=True)
        results = {}
        for n_max in args.draft_max:
            for p_min in args.p_min:
                recs = [ll.speculative(p, target, draft, args.new_tokens, ctx, n_max, p_min) for p in sweep_ps]
                out["sweep"].extend(recs)
                results[(n_max, p_min)] = aggregate(recs, "decoded_tokens", "decoded_seconds")
        working = {k: v for k, v in results.items() if v["tps"]}
        if not working:
            continue
        n_max, p_min = max(working, key=lambda k: working[k]["tps"])
        out["best"][s] = {"n_max": n_max, "p_min": p_min, "sweep_tps": working[(n_max, p_min)]["tps"]}
        rest = [p for p in ps if p not in sweep_ps]
        final = [r for r in out["sweep"] if r["set"] == s and r["n_max"] == n_max and r["p_min"] == p_min]
        if rest:
            print(f"llama-speculative-simple best setting on the rest of {s}:", flush=True)
            final += [ll.speculative(p, target, draft, args.new_tokens, ctx, n_max, p_min) for p in rest]
        out["final"].extend(final)
    out["summary"] = {}
    for s in out["best"]:
        recs = [r for r in out["final"] if r["set"] == s]
        agg = aggregate(recs, "decoded_tokens", "decoded_seconds")
        drafted = sum(r.get("n_drafted", 0) for r in recs)
        accepted = sum(r.get("n_accept", 0) for r in recs)
        same = [same_greedy_text(r.get("text"), plain_by[(s, r["id"])].get("text")) for r in recs
                if r.get("ok") and (s, r["id"]) in plain_by and plain_by[(s, r["id"])].get("ok")]
        pl = [plain_by[(s, r["id"])] for r in recs if (s, r["id"]) in plain_by]
        pl_agg = aggregate(pl, "eval_tokens", "eval_ms")
        plain_tps = pl_agg["tokens"] / (pl_agg["seconds"] / 1e3) if pl_agg["seconds"] else None
        out["summary"][s] = {**out["best"][s], **agg, "n_drafted": drafted, "n_accept": accepted,
                             "acceptance": accepted / drafted if drafted else None,
                             "plain_tps": plain_tps, "speedup": agg["tps"] / plain_tps if agg["tps"] and plain_tps
                             else None, "same_text_as_plain": f"{sum(same)}/{len(same)}"}
    return out


def check_tokens(prompts: list[Prompt], plain: list[dict], gguf: str) -> dict:
    """llama.cpp's prompt ids against specjax's tokenizer on the same text."""
    from specjax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)
    by = {(r["set"], r["id"]): r.get("prompt_ids") for r in plain}
    mism = [f"{p.set}/{p.id}" for p in prompts if by.get((p.set, p.id)) != tok.encode(p.text)]
    return {"checked": len(prompts), "mismatched": mism}


# -- HF transformers ------------------------------------------------------------------------------------------------

def run_hf(args, target: str, draft: str, prompts: list[Prompt], out: dict) -> None:
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise PairBenchError(f"the hf peer needs the parity extra: pip install -e '.[parity]' ({e})") from None
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.hf_dtype]

    def load(path):
        d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        t = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
        return m, time.perf_counter() - t

    res: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": args.hf_dtype,
                 "threads": torch.get_num_threads(), "modes": {}}
    out["hf"] = res
    print("transformers: loading the target and the drafter (GGUF, dequantized)...", flush=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(target)), gguf_file=os.path.basename(target))
    model, res["load_s_target"] = load(target)
    assistant, res["load_s_draft"] = load(draft) if "assisted" in args.hf_modes else (None, 0.0)
    from specjax.models.tokenizer import Tokenizer
    sj = Tokenizer.from_gguf(target)

    modes = {"plain": {}, "assisted": {"assistant_model": assistant},
             "prompt_lookup": {"prompt_lookup_num_tokens": args.hf_lookup_tokens}}
    if assistant is not None and args.hf_assistant_tokens:
        assistant.generation_config.num_assistant_tokens = args.hf_assistant_tokens
        assistant.generation_config.num_assistant_tokens_schedule = args.hf_assistant_schedule
    mismatched = []
    prefill: dict[tuple[str, str], float] = {}
    for mode in args.hf_modes:
        recs = []
        print(f"transformers {mode}:", flush=True)
        for i, p in enumerate(prompts):
            enc = tok(p.text, return_tensors="pt", add_special_tokens=False)
            if mode == args.hf_modes[0] and enc["input_ids"][0].tolist() != sj.encode(p.text):
                mismatched.append(f"{p.set}/{p.id}")
            gen = dict(max_new_tokens=args.new_tokens, do_sample=False, **modes[mode])
            with torch.no_grad():
                if i == 0:  # warm-up outside the timing
                    model.generate(**enc, **{**gen, "max_new_tokens": 4})
                if (p.set, p.id) not in prefill:  # one plain prefill + first token, to report decode-only speed
                    t = time.perf_counter()
                    model.generate(**enc, max_new_tokens=1, do_sample=False)
                    prefill[(p.set, p.id)] = time.perf_counter() - t
                t = time.perf_counter()
                ids = model.generate(**enc, **gen)[0, enc["input_ids"].shape[1]:].tolist()
                dt = time.perf_counter() - t
            recs.append({"id": p.id, "set": p.set, "new_tokens": len(ids), "seconds": dt,
                         "prefill_seconds": prefill[(p.set, p.id)], "token_ids": ids})
            print(f"  {p.set}/{p.id}: {len(ids)} tokens, {len(ids) / dt:.2f} tok/s", flush=True)
        res["modes"][mode] = recs
    res["token_check"] = {"checked": len(prompts), "mismatched": mismatched}
    plain = {(r["set"], r["id"]): r["token_ids"] for r in res["modes"].get("plain", [])}
    res["summary"] = {}
    for mode, recs in res["modes"].items():
        for s in sets_of(prompts):
            rs = [r for r in recs if r["set"] == s]
            toks, secs = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
            # decode only: the tokens after the first over the time after a plain prefill + first token
            dtoks = sum(r["new_tokens"] - 1 for r in rs)
            dsecs = sum(max(r["seconds"] - r["prefill_seconds"], 0.0) for r in rs)
            same = [r["token_ids"] == plain[(s, r["id"])] for r in rs if (s, r["id"]) in plain]
            res["summary"][f"{mode}/{s}"] = {"tokens": toks, "seconds": secs, "tps": toks / secs if secs else None,
                                             "decode_tps": dtoks / dsecs if dsecs else None,
                                             "same_as_plain": f"{sum(same)}/{len(same)}"}
    for key, v in res["summary"].items():
        mode, s = key.split("/")
        base = res["summary"].get(f"plain/{s}", {})
        v["speedup"] = v["tps"] / base["tps"] if base.get("tps") and v["tps"] else None
        v["decode_speedup"] = (v["decode_tps"] / base["decode_tps"] if base.get("decode_tps") and v["decode_tps"]
                               else None)


# -- report ---------------------------------------------------------------------------------------------------------

def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(out: dict) -> None:
    print(f"\nCPU: {out['cpu']} ({', '.join(out['cpu_flags'])}), threads {out['threads']}")
    ll = out.get("llama_cpp")
    if ll:
        print(f"llama.cpp {ll['version'].get('version', '?')} commit {ll['version'].get('commit', '?')}")
        if ll.get("bench"):
            print("\n| model | repack | tg tok/s | pp tok/s | status |\n|---|---|---|---|---|")
            for r in ll["bench"] + ll.get("bench_last", []):
                st = "ok" if r["ok"] else (r["signal"] or f"rc {r['rc']}")
                print(f"| {r['model']} | {r['repack']}{' (chosen)' if r.get('chosen') else ''} | "
                      f"{fmt(r.get('tg_tps'))} | {fmt(r.get('pp_tps'))} | {st} |")
        if ll.get("batched", {}).get("rows"):
            print("\n| parallel seqs | tg tok/s (all seqs) | pp tok/s |\n|---|---|---|")
            for r in ll["batched"]["rows"]:
                print(f"| {r['pl']} | {fmt(r['speed_tg'])} | {fmt(r['speed_pp'])} |")
        if ll.get("plain_summary"):
            print("\n| prompt set | plain tok/s (llama-completion eval) | prompts ok |\n|---|---|---|")
            for s, v in ll["plain_summary"].items():
                print(f"| {s} | {fmt(v['tps'])} | {v['ok']}/{v['prompts']} |")
        if ll.get("token_check"):
            tc = ll["token_check"]
            print(f"prompt tokens llama.cpp vs specjax: {tc['checked'] - len(tc['mismatched'])}/{tc['checked']} equal")
        spec = ll.get("spec", {})
        if spec.get("sweep"):
            print("\n| set | draft max | p_min | tok/s | accept % | ok |\n|---|---|---|---|---|---|")
            cells = {}
            for r in spec["sweep"]:
                cells.setdefault((r["set"], r["n_max"], r["p_min"]), []).append(r)
            for (s, n, pm), rs in cells.items():
                a = aggregate(rs, "decoded_tokens", "decoded_seconds")
                dr, ac = sum(r.get("n_drafted", 0) for r in rs), sum(r.get("n_accept", 0) for r in rs)
                print(f"| {s} | {n} | {pm} | {fmt(a['tps'])} | {fmt(100 * ac / dr if dr else None, '.1f')} | "
                      f"{a['ok']}/{a['prompts']} |")
        if spec.get("summary"):
            print("\n| set | best (max, p_min) | spec tok/s | plain tok/s | speedup | acceptance | same text |\n"
                  "|---|---|---|---|---|---|---|")
            for s, v in spec["summary"].items():
                print(f"| {s} | {v['n_max']}, {v['p_min']} | {fmt(v['tps'])} | {fmt(v['plain_tps'])} | "
                      f"{fmt(v['speedup'])} | {fmt(v['acceptance'], '.3f')} | {v['same_text_as_plain']} |")
    hf = out.get("hf")
    if hf and hf.get("summary"):
        print(f"\ntransformers {hf['transformers']}, torch {hf['torch']}, {hf['dtype']}, {hf['threads']} threads")
        print("| mode / set | tok/s (with prefill) | speedup | decode tok/s | decode speedup | same tokens as plain |\n"
              "|---|---|---|---|---|---|")
        for k, v in hf["summary"].items():
            print(f"| {k} | {fmt(v['tps'])} | {fmt(v['speedup'])} | {fmt(v['decode_tps'])} | "
                  f"{fmt(v['decode_speedup'])} | {v['same_as_plain']} |")


def csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def csv_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="directory with llama.cpp's binaries (default: $LLAMA_CPP_BIN)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="alias or .gguf path")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="alias or .gguf path")
    ap.add_argument("--peers", default="llama.cpp", help="comma list of llama.cpp, hf")
    ap.add_argument("--parts", default="bench,batched,plain,spec", help="llama.cpp parts: bench,batched,plain,spec")
    ap.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS, help="JSONL prompt files")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context size for llama-completion / -speculative-simple")
    ap.add_argument("--bench-prompt", type=int, default=128, help="llama-bench pp and batched-bench prompt length")
    ap.add_argument("--reps", type=int, default=5, help="llama-bench repetitions")
    ap.add_argument("--repack", choices=["both", "0", "1"], default="both",
                    help="llama-bench repack settings to try; 'both' picks the fastest that works")
    ap.add_argument("--bench-extra", nargs="*", default=[], help="more .gguf files for llama-bench (e.g. SmolLM2's)")
    ap.add_argument("--npl", type=csv_ints, default=[1, 4, 8], help="batched-bench parallel sequences")
    ap.add_argument("--draft-max", type=csv_ints, default=[3, 5, 8, 16])
    ap.add_argument("--p-min", type=csv_floats, default=[0.0, 0.75, 0.9])
    ap.add_argument("--sweep-limit", type=int, default=4,
                    help="sweep draft settings on the first N prompts of each set (0: all), then the best on all")
    ap.add_argument("--plain-last", action="store_true", help="llama-bench the target again at the end")
    ap.add_argument("--check-tokens", action="store_true", help="compare llama.cpp's prompt ids with specjax's")
    ap.add_argument("--tool-timeout", type=float, default=900, help="seconds before one tool run is killed")
    ap.add_argument("--hf-modes", nargs="+", default=["plain", "assisted", "prompt_lookup"],
                    choices=["plain", "assisted", "prompt_lookup"])
    ap.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--hf-assistant-tokens", type=int, default=None,
                    help="num_assistant_tokens (default: transformers' own)")
    ap.add_argument("--hf-assistant-schedule", default="heuristic", choices=["heuristic", "constant"])
    ap.add_argument("--json", default=None, help="write everything here")
    args = ap.parse_args(argv)

    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    try:
        bad = [x for x in peers if x not in ("llama.cpp", "hf")] + \
              [x for x in args.parts if x not in ("bench", "batched", "plain", "spec")]
        if bad:
            raise PairBenchError(f"unknown peer or part: {', '.join(bad)}")
        if "llama.cpp" in peers and not args.llama_cpp_bin:
            raise PairBenchError("give --llama-cpp-bin or set LLAMA_CPP_BIN to llama.cpp's build/bin directory")
        target, draft = resolve_gguf(args.target), resolve_gguf(args.draft)
        prompts = wrap_prompts(load_prompts(args.prompts, args.limit), target)
        out = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads, "argv": sys.argv,
               "target": target, "draft": draft, "new_tokens": args.new_tokens,
               "prompt_sets": {s: sum(p.set == s for p in prompts) for s in sets_of(prompts)},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if "llama.cpp" in peers:
            run_llama_cpp(args, target, draft, prompts, out)
        if "hf" in peers:
            run_hf(args, target, draft, prompts, out)
    except PairBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_tables(out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
