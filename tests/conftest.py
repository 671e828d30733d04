"""Shared test setup. specjax must be installed (`pip install -e .[test]`): that is what maps the top-level
`backends/` and `kernels/` folders to `specjax.backends` and `specjax.kernels`."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
SPEC_BENCH = os.path.join(SHARED, "data", "spec_bench", "question.jsonl")
