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
    """set_policy(variable, value) sets a CPU kernel policy (SPECJAX_CPU_MATMUL, SPECJAX_CPU_ATTENTION) for one
    test, dropping every traced function before and after: the policies are read when a function is traced."""
    def set_policy(variable: str, value: str):
        monkeypatch.setenv(variable, value)
        jax.clear_caches()
    yield set_policy
    jax.clear_caches()
