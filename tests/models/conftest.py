"""Fixtures of tests/models: the Qwen2.5-Coder GGUF files, found the way a user names them."""
from __future__ import annotations

import os

import pytest

from specjax.models.loading import ModelLoadError, resolve_model

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
