"""House rules a reading of the package would otherwise have to check by hand, checked over every module of
specjax (the `backends/` and `kernels/` folders included):

- no `from x import _private` across modules (a name another module needs is public where it lives);
- no measured figure in a code comment (tok/s, ms, "1.4x", MB/s, "20% faster"): figures live in reports/, and a
  comment cites the report;
- no duck-typed drafter capabilities: runners read `drafter.capabilities` (specjax.drafters.base), never
  `getattr(drafter, "host_side", ...)` or `type(x).__name__ == ...`.

Each check is a function over (path, source), and the planted-violation tests at the bottom show that each one
fails on what it is meant to catch and passes the legitimate look-alikes.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("specjax", "backends", "kernels")

# A measured figure: a rate or a duration with its unit, a multiple ("1.4x"), a bandwidth, or a percentage
# called faster / slower. Sizes and limits ("64 MiB", "1 s threshold") are settings, not measurements.
FIGURE = re.compile(
    r"\d(?:\.\d+)?\s?(?:tok/s|tokens/s|ms|µs|us)\b"
    r"|\b\d+(?:\.\d+)?x\b"
    r"|\d\s?[KMG]i?B/s"
    r"|\d%\s+(?:faster|slower)",
    re.I,
)
# Capabilities probed instead of declared: a drafter's host side, a class name, or getattr / hasattr on the
# objects whose interfaces declare what they can do (the model, a host-driver variant, a drafter).
DUCK_TYPED = re.compile(r"getattr\([^)]*[\"']host_side[\"']|type\([^)]*\)\.__name__\s*=="
                        r"|(?:getattr|hasattr)\((?:self\.)?(?:llm|variant|drafter)\s*,")


def package_sources() -> list[tuple[str, str]]:
    found = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found.append((str(path.relative_to(ROOT)), path.read_text()))
    assert len(found) > 50, "the scan found too few modules to mean anything"
    return found


def private_imports(path: str, source: str) -> list[str]:
    """`from specjax.x import _name` (or a relative import of an underscored name) anywhere in the module."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "specjax"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {alias.name}")
    return bad


def figure_comments(path: str, source: str) -> list[str]:
    """Measured figures in comments and docstrings (a docstring is a comment a reader meets first)."""
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
            bad.append(f"{path}:{tok.start[0]}: {tok.string.strip()}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            for i, line in enumerate(doc.splitlines()):
                if FIGURE.search(line):
                    bad.append(f"{path}:{getattr(node, 'lineno', 1)}+{i}: {line.strip()}")
    return bad


def duck_typed_capabilities(path: str, source: str) -> list[str]:
    return [f"{path}:{i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1) if DUCK_TYPED.search(line)]


@pytest.mark.parametrize("check", [private_imports, figure_comments, duck_typed_capabilities],
                         ids=["private-imports", "figures-in-comments", "duck-typed-capabilities"])
def test_package_keeps_the_rule(check):
    found = [hit for path, source in package_sources() for hit in check(path, source)]
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------------------------------- planted violations
def test_planted_private_import_is_caught():
    planted = ("from specjax.kernels.reference import _masked_attention\n"
               "from .machinery import _coerce, did_you_mean\n")
    assert [h.split(": ", 1)[1] for h in private_imports("x.py", planted)] == [
        "from specjax.kernels.reference import _masked_attention", "from .machinery import _coerce"]
    fine = ("from specjax.config import did_you_mean\nfrom typing import _GenericAlias\n"
            "from specjax import __version__\n")
    assert private_imports("x.py", fine) == []


@pytest.mark.parametrize("comment", [
    "# decode batch 1: 35.2 -> 39.5 tok/s",
    "# 26 -> 12 ms at 8 tokens",
    "# made the loop 1.4x slower than plain decoding",
    "# 10-25% faster target forwards",
    "# reads 37.9 GB/s",
])
def test_planted_figure_comment_is_caught(comment):
    assert len(figure_comments("x.py", f"x = 1  {comment}\n")) == 1
    text = comment.lstrip("# ")
    assert len(figure_comments("x.py", f'def f():\n    """Why: {text}."""\n')) == 1
    assert len(figure_comments("x.py", f'"""A module.\n\n{text}\n"""\n')) == 1


@pytest.mark.parametrize("comment", [
    "# figures: reports/decode_cpu/README.md",
    "# 64 MiB leaves room for huge added-token tables",
    "# [B, Hkv, S, D] per layer, 16 rows max",
])
def test_figure_look_alikes_pass(comment):
    assert figure_comments("x.py", f"x = 1  {comment}\n") == []
    assert figure_comments("x.py", f'class C:\n    """{comment.lstrip("# ")}"""\n') == []


def test_planted_duck_typed_capability_is_caught():
    planted = ('if getattr(drafter, "host_side", False):\n    pass\n'
               'cfg = d.config if type(d).__name__ == "DraftModelDrafter" else None\n'
               'on_mesh = getattr(llm, "on_mesh", contextlib.nullcontext)\n'
               'if getattr(variant, "adaptive", None) is None or not hasattr(variant, "slot_break_even"):\n'
               '    pass\n')
    assert len(duck_typed_capabilities("x.py", planted)) == 4
    assert duck_typed_capabilities("x.py", "if drafter.capabilities.host_side:\n    pass\n") == []
