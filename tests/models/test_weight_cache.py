"""The dequantized-weights cache: a second load reads the entry instead of the GGUF file's tensors, bit for bit
the same params (transposed tensors and bfloat16 included); a changed file, a corrupt entry or an entry that
does not fit the config never reaches the model; the switch, the size floor and pruning work."""
from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest

from helpers import tiny_config, tiny_params, write_gguf
from specjax.models import loading, weight_cache
from specjax.models.gguf_file import GGUFFile


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    return tmp_path / "cache" / "weights"


@pytest.fixture
def reads(monkeypatch):
    """How many tensors were dequantized from a GGUF file."""
    count = [0]
    real = GGUFFile.tensor_float32

    def spy(self, t):
        count[0] += 1
        return real(self, t)

    monkeypatch.setattr(GGUFFile, "tensor_float32", spy)
    return count


def _flat(params):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _same(a, b):
    fa, fb = _flat(a), _flat(b)
    return set(fa) == set(fb) and all(fa[k].dtype == fb[k].dtype and np.array_equal(fa[k], fb[k]) for k in fa)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_reads_the_entry_bit_for_bit(tmp_path, cache, reads, dtype):
    cfg = tiny_config()  # untied: lm_head is a transposed view of output.weight
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg, seed=1))
    _, first, _ = loading.load_gguf(path, dtype)
    n = reads[0]
    assert n > 0 and len(list(cache.glob("*.safetensors"))) == 1
    _, second, _ = loading.load_gguf(path, dtype)
    assert reads[0] == n  # nothing dequantized the second time
    assert _same(first, second)


def test_a_changed_file_is_read_again(tmp_path, cache, reads):
    cfg = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg, seed=1))
    loading.load_gguf(path)
    time.sleep(0.01)
    write_gguf(path, cfg, tiny_params(cfg, seed=2))
    n = reads[0]
    _, params, _ = loading.load_gguf(path)
    assert reads[0] > n
    os.environ["SPECJAX_WEIGHT_CACHE"] = "0"
    try:
        _, fresh, _ = loading.load_gguf(path)
    finally:
        del os.environ["SPECJAX_WEIGHT_CACHE"]
    assert _same(params, fresh)


def test_corrupt_or_misfit_entries_are_dropped(tmp_path, cache, reads):
    cfg = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg, seed=1))
    _, ref, _ = loading.load_gguf(path)
    entry = weight_cache.entry_path(path, "float32")
    entry.write_bytes(entry.read_bytes()[:100])  # torn
    _, params, _ = loading.load_gguf(path)
    assert _same(params, ref)
    # An entry holding another model's tensors under this file's name: its shapes do not fit the config.
    other = tiny_config(hidden_size=32)
    weight_cache.store(path, "float32", loading.load_gguf(write_gguf(tmp_path / "o.gguf", other,
                                                                     tiny_params(other, seed=3)))[1])
    n = reads[0]
    _, params, _ = loading.load_gguf(path)
    assert reads[0] > n and _same(params, ref)


def test_switch_size_floor_and_pruning(tmp_path, cache, monkeypatch):
    cfg = tiny_config()
    paths = [write_gguf(tmp_path / f"m{i}.gguf", cfg, tiny_params(cfg, seed=i)) for i in range(3)]
    monkeypatch.setenv("SPECJAX_WEIGHT_CACHE", "0")
    loading.load_gguf(paths[0])
    assert not cache.exists() or not list(cache.glob("*.safetensors"))
    monkeypatch.delenv("SPECJAX_WEIGHT_CACHE")
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", os.path.getsize(paths[0]) + 1)
    loading.load_gguf(paths[0])
    assert not cache.exists() or not list(cache.glob("*.safetensors"))
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(weight_cache, "MAX_ENTRIES", 2)
    for p in paths:
        loading.load_gguf(p)
        time.sleep(0.01)
    assert sorted(cache.glob("*.safetensors")) == sorted(weight_cache.entry_path(p, "float32") for p in paths[1:])
    os.remove(paths[2])
    loading.load_gguf(paths[0])  # writing an entry prunes the one whose file is gone
    assert sorted(cache.glob("*.safetensors")) == sorted(weight_cache.entry_path(p, "float32")
                                                         for p in paths[:2])


def test_an_unwritable_cache_only_warns(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    cfg = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg, seed=1))
    with pytest.warns(UserWarning, match="could not write its weight cache"):
        _, params, _ = loading.load_gguf(path)
    assert params["embed"].shape == (cfg.vocab_size, cfg.hidden_size)
