"""Shared test setup. specjax must be installed (`pip install -e .[test]`): that is what maps the top-level
`backends/` and `kernels/` folders to `specjax.backends` and `specjax.kernels`."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _drop_checkout_root_from_path() -> None:
    """`python -m pytest` puts the checkout's root on sys.path, where the top-level `kernels/` folder (installed
    as `specjax.kernels`) shadows the Hugging Face `kernels` distribution that transformers >= 5.25 requires and
    imports: the parity tests then fail inside transformers. specjax itself is reached through its installed
    finder, so the root entry is not needed."""
    root = os.path.realpath(ROOT)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    for name in ("kernels", "backends"):
        module = sys.modules.get(name)
        if module is not None and os.path.realpath(getattr(module, "__file__", "") or "").startswith(root + os.sep):
            del sys.modules[name]


_drop_checkout_root_from_path()
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
SPEC_BENCH = os.path.join(SHARED, "data", "spec_bench", "question.jsonl")


import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop JAX's compiled programs after every test module.

    Each compiled XLA:CPU program keeps its own memory mappings, and one process running the whole suite builds
    thousands of them: without this the mapping count reaches the kernel's vm.max_map_count (65530 by default)
    and XLA aborts the process inside a compile (SIGABRT, no Python traceback)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def kernel_policy(monkeypatch):
    """set_policy(op, implementation) adds `op=implementation` to SPECJAX_KERNELS (the kernel table's override,
    specjax.backends.ops) for one test, dropping every traced function before and after: the table chooses when a
    function is traced."""
    chosen: dict[str, str] = {}

    def set_policy(op: str, implementation: str):
        chosen[op] = implementation
        monkeypatch.setenv("SPECJAX_KERNELS", ",".join(f"{k}={v}" for k, v in chosen.items()))
        jax.clear_caches()
    yield set_policy
    jax.clear_caches()


@pytest.fixture
def kernels_unbuildable(monkeypatch):
    """For one test, the CPU kernels cannot be built (no C++ compiler), and each kernel's one-time fallback warning
    is armed again before and after."""
    from specjax.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "_load", lambda: (False, "no C++ compiler found (set CXX, or install g++)"))
    cpu_build.warn_unavailable.cache_clear()
    yield
    cpu_build.warn_unavailable.cache_clear()


@pytest.fixture(scope="module")
def fast_xla_compiles():
    """Skip most XLA optimisation for one module (`pytestmark = pytest.mark.usefixtures("fast_xla_compiles")`):
    for modules that compare runs with each other or count traces, not against fixed numbers, and compile many
    small programs (or interpret-mode kernels) whose compile time this cuts. A global flag, restored after."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture
def trace_counter(monkeypatch):
    """Counter of target forward traces by kind ('prefill' for T > 1, 'decode' for T == 1)."""
    import collections

    from specjax import engine

    counts = collections.Counter()
    real = engine.forward

    def counting_forward(params, config, tokens, *args, **kwargs):
        counts["prefill" if tokens.shape[1] > 1 else "decode"] += 1
        return real(params, config, tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "forward", counting_forward)
    return counts


# ------------------------------------------------------------------ the Qwen2.5-Coder GGUF files (tests/models)
# One conftest module only: test modules import names from `conftest` (pythonpath = tests), which a second
# conftest.py in a sub-folder would shadow.
from specjax.models.loading import ModelLoadError, resolve_model  # noqa: E402

# size -> (alias, environment variable naming the .gguf file when the alias does not resolve)
QWEN_GGUF = {
    "1.5b": ("qwen2.5-coder-1.5b", "SPECJAX_QWEN15_GGUF"),
    "0.5b": ("qwen2.5-coder-0.5b", "SPECJAX_QWEN05_GGUF"),
}


def qwen_gguf_path(size: str) -> str:
    """The Qwen2.5-Coder GGUF of `size`: the alias through `resolve_model` (the part packages), else the file the
    environment variable names; a skip saying both when neither is there. A variable naming a missing file is a
    failure, not a skip: whoever set it meant the tests to run."""
    alias, variable = QWEN_GGUF[size]
    try:
        files = resolve_model(alias)
    except ModelLoadError as err:
        reason = str(err)
    else:
        if files.kind != "gguf":
            pytest.fail(f"{alias!r} resolved to a {files.kind} model at {files.path}; these tests need its GGUF file")
        return files.path
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"Qwen2.5-Coder-{size.upper()} GGUF not available: {alias!r} does not resolve ({reason[:200]}) "
                    f"and {variable} is not set to a .gguf file")
    if not os.path.isfile(path):
        pytest.fail(f"{variable}={path!r} names no file")
    return path


@pytest.fixture(scope="session")
def qwen05_gguf() -> str:
    return qwen_gguf_path("0.5b")


@pytest.fixture(scope="session")
def qwen15_gguf() -> str:
    return qwen_gguf_path("1.5b")
