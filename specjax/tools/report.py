"""Benchmark reporting: the tables (rich console, Markdown) and PNG plots of what `specjax.tools.bench` measured.

Inputs are the plain dicts the runner produces: `bench.summarize` ({method: {category|'overall': figures}}), the
throughput table ({method: {batch: figures}}) and the profile figures ({method: draft/verify figures}). Lossy
configurations carry LOSSY in their label, and every Markdown table that holds one says what that means.
"""
from __future__ import annotations

import numpy as np

from specjax.tools.bench import LOSSY_TAG


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed (plots are
    optional: the JSON and Markdown reports do not need them)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: str) -> str:
    """Lay out, write and close one figure; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _categories(summary: dict) -> list[str]:
    """The table columns: every category of the first method, then 'overall'."""
    return [c for c in next(iter(summary.values())) if c != "overall"] + ["overall"]


# τ and tokens per forward differ exactly by the plain (backed-off) steps; a table that shows one shows both.
TAU_NOTE = ("τ = 1 + accepted / verify steps (mean accepted length, as in the papers and vLLM; plain backed-off "
            "steps not counted); tok/fwd = new tokens per decoding target forward (verify and plain steps, prefill "
            "excluded): what bounds the speedup.")


def _spec_text(a: dict, console: bool = False) -> str:
    """alpha, tau and tokens per target forward of one figures dict that has them ('' where the method did not
    draft); tok/fwd is left out of figures written before it existed."""
    if "tau" not in a:
        return ""
    tpf = a.get("tokens_per_forward")
    if console:
        return f"\nα{a['acceptance_rate']:.2f} τ{a['tau']:.2f}" + ("" if tpf is None else f" {tpf:.2f}/fwd")
    return f", α {a['acceptance_rate']:.2f}, τ {a['tau']:.2f}" + ("" if tpf is None else f", {tpf:.2f} tok/fwd")


def _cell(a: dict, method: str, console: bool = False) -> str:
    """One method x category entry: tokens/s, the speedup over plain (not on plain itself), alpha, tau and tokens
    per target forward where the method drafted; `console` is the terser two-line form of the rich table."""
    s = f"{a['tokens_per_s']:.1f}" + ("" if console else " tok/s")
    if "speedup" in a and method != "plain":
        s += (" " if console else ", ") + f"{a['speedup']:.2f}x"
        if "decode_speedup" in a:  # the decode phase alone, the prompt's prefill left out
            s += f" (decode {a['decode_speedup']:.2f}x)"
    return s + _spec_text(a, console)


def speculation_markdown(summary: dict) -> list[str]:
    """One row per speculative method (overall): alpha, tau and tokens per target forward, a column each."""
    rows = {m: per["overall"] for m, per in summary.items() if "tau" in per["overall"]}
    if not rows:
        return []
    lines = ["Speculation (overall):", "", "| method | α | τ | tok/fwd |", "|---|---|---|---|"]
    for m, a in rows.items():
        tpf = a.get("tokens_per_forward")
        lines.append(f"| {m} | {a['acceptance_rate']:.2f} | {a['tau']:.2f} | "
                     + ("" if tpf is None else f"{tpf:.2f}") + " |")
    return lines + ["", TAU_NOTE, ""]


def markdown(summary: dict, title: str) -> str:
    """The per-category table of one temperature, the greedy-equality line, the LOSSY note, the alpha / tau /
    tokens-per-forward table, per-position rates."""
    lines = [f"## {title}", ""]
    cats = _categories(summary)
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for method, per in summary.items():
        lines.append(f"| {method} | " + " | ".join(_cell(per[c], method) for c in cats) + " |")
    lines.append("")
    same = {m: per["overall"]["identical_to_plain"] for m, per in summary.items()
            if "identical_to_plain" in per["overall"]}
    if same:
        lines += ["Greedy output identical to plain greedy, token for token: " + "; ".join(
            f"{m} {a}/{n}" for m, (a, n) in same.items()), ""]
    if any(per["overall"].get("lossy") for per in summary.values()):
        lines += [f"{LOSSY_TAG}: typical acceptance; outputs do not follow the target model's distribution.", ""]
    lines += speculation_markdown(summary)
    lines += per_position_markdown(summary)
    return "\n".join(lines) + "\n"


def per_position_markdown(summary: dict) -> list[str]:
    """One row per speculative method: acceptance rate at draft depth 1, 2, ... (overall)."""
    rows = {m: per["overall"]["per_position"] for m, per in summary.items() if "per_position" in per["overall"]}
    if not rows:
        return []
    depth = max(len(v) for v in rows.values())
    lines = ["Per-position acceptance (overall):", "", "| method | " + " | ".join(f"d{i}" for i in
                                                                               range(1, depth + 1)) + " |",
             "|---|" + "---|" * depth]
    for m, pp in rows.items():
        lines.append(f"| {m} | " + " | ".join(f"{x:.2f}" for x in pp) + " |" + " |" * (depth - len(pp)))
    return lines + [""]


def throughput_markdown(table: dict, title: str) -> str:
    """{method: {batch: figures}} -> the 'tokens/s against batch size' table."""
    batches = sorted({int(b) for per in table.values() for b in per})
    lines = [f"### {title}: tokens/s against batch size", "", "| method | " + " | ".join(f"batch {b}" for b in
                                                                                        batches) + " |",
             "|---|" + "---|" * len(batches)]
    for method, per in table.items():
        cells = []
        for b in batches:
            f = per.get(str(b))
            if f is None:
                cells.append("")
                continue
            cell = f"{f['tokens_per_s']:.1f}" + _spec_text(f)
            if f.get("greedy_equal_to_batch1") is False:
                cell += ", greedy differs from batch 1"
            elif f.get("greedy_equal_to_plain_batch1") is True:
                cell += ", = plain greedy"
            elif f.get("greedy_equal_to_plain_batch1") is False:
                cell += ", greedy differs from plain"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Every batch size is timed around whole `llm.generate` calls (batch 1: the per-prompt run).",
              ""]
    if any("tau" in f for per in table.values() for f in per.values()):
        lines += [TAU_NOTE, ""]
    return "\n".join(lines)


def profile_markdown(profile: dict, title: str) -> str:
    """{method: profile_figures} -> the draft against verify time table."""
    lines = [f"### {title}: draft vs verify time (host-stepped, batch 1)", "",
             "| method | prompts | draft s | verify s | draft share | verify ms/step | draft ms/step |",
             "|---|---|---|---|---|---|---|"]
    for m, f in profile.items():
        lines.append(f"| {m} | {f['requests']} | {f['draft_s']:.3f} | {f['verify_s']:.3f} | "
                     f"{100 * f['draft_share']:.0f}% | {f['verify_ms_per_step']:.2f} | {f['draft_ms_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def print_table(summary: dict, title: str) -> None:
    """The per-category table on the console (rich), Markdown where rich is missing."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        print(markdown(summary, title))
        return
    cats = _categories(summary)
    t = Table(title=title)
    t.add_column("method")
    for c in cats:
        t.add_column(c, justify="right")
    for method, per in summary.items():
        t.add_row(method, *(_cell(per[c], method, console=True) for c in cats))
    Console().print(t)


def plot(summary: dict, path_prefix: str, title: str) -> list[str]:
    """PNG plots: speedup by category and method, acceptance by position. Returns the files written."""
    plt = pyplot()
    if plt is None:
        return []
    files = []
    cats = _categories(summary)
    methods = [m for m in summary if m != "plain"]
    if methods:
        fig, ax = plt.subplots(figsize=(max(6, len(cats) * 0.9), 4))
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ax.bar(np.arange(len(cats)) + i * w, [summary[m][c].get("speedup", np.nan) for c in cats], w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(cats)) + 0.4 - w / 2, cats, rotation=30, ha="right")
        ax.set_ylabel("speedup over specjax plain")
        ax.set_title(f"{title}: speedup by category")
        ax.legend(fontsize=7)
        files.append(_save(plt, fig, f"{path_prefix}_speedup.png"))
    spec = [m for m in summary if "per_position" in summary[m]["overall"]]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in spec:
            pp = summary[m]["overall"]["per_position"]
            ax.plot(np.arange(1, len(pp) + 1), pp, marker="o", label=m)
        ax.set_xlabel("draft position (depth)")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"{title}: acceptance by position")
        ax.legend(fontsize=7)
        files.append(_save(plt, fig, f"{path_prefix}_acceptance.png"))
    return files


def plot_throughput(table: dict, path: str, title: str) -> list[str]:
    """PNG: tokens/s against batch size, one line per method. Returns the files written."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, per in table.items():
        batches = sorted(int(b) for b in per)
        ax.plot(batches, [per[str(b)]["tokens_per_s"] for b in batches], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{title}: tokens/s against batch size")
    ax.legend(fontsize=7)
    return [_save(plt, fig, path)]


def plot_compare(rows: list[dict], path: str) -> list[str]:
    """PNG: tokens/s of every (target, method) row of `specjax compare`. Returns the files written."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(max(5, len(rows) * 0.8), 3.5))
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['target']}\n{r['method']}" for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s (batch 1, greedy)")
    return [_save(plt, fig, path)]
