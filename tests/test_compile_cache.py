"""The persistent compilation cache (`specjax.compile_cache`) and the CPU kernels' build key.

What is proven: the cache directory's key changes with each input that makes a compiled program unsafe to reuse
(jax or jaxlib version, OS, architecture, CPU feature flags) and stays put otherwise; the root follows
SPECJAX_CACHE_DIR, then XDG_CACHE_HOME, then HOME; SPECJAX_COMPILATION_CACHE=0 leaves JAX alone; an unwritable
directory warns once and leaves JAX alone; a cache directory the user gave JAX wins; `load_model` turns the cache
on; and, across two real processes, a program compiled by the first is read from disk by the second (JAX's
cache-hit event, no miss), while a process on a "different CPU" misses and writes its own directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax import compile_cache
from specjax.kernels import cpu_build

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\nCPU implementer\t: 0x41\n"


@pytest.fixture
def jax_cache_config():
    """Restore JAX's cache settings, and forget any cache JAX opened, after a test that may change them."""
    from jax._src import compilation_cache as jcc

    saved = {k: jax.config.values[k] for k in ("jax_compilation_cache_dir",
                                               "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    jcc.reset_cache()


# ------------------------------------------------------------------------------------------------ the key
def test_cpu_flags_read_x86_and_arm_lines_and_nothing_else():
    assert compile_cache.cpu_flags(X86) == ("avx", "avx2", "fma", "fpu", "sse2")
    assert compile_cache.cpu_flags(ARM) == ("aes", "asimd", "crc32", "evtstrm", "fp")
    assert compile_cache.cpu_flags("processor : 0\nmodel name : something\n") == ()
    assert compile_cache.cpu_flags("") == ()


def test_fingerprint_changes_with_the_flags_not_their_order():
    base = compile_cache.cpu_fingerprint(("avx", "avx2", "sse2"))
    assert compile_cache.cpu_fingerprint(("avx", "avx2", "sse2")) == base
    assert compile_cache.cpu_fingerprint(("avx", "avx2", "avx512f", "sse2")) != base
    assert compile_cache.cpu_fingerprint(compile_cache.cpu_flags(X86.replace("avx2 ", ""))) != \
        compile_cache.cpu_fingerprint(compile_cache.cpu_flags(X86))
    shuffled = X86.replace("fpu sse2 avx avx2 fma", "fma avx2 avx sse2 fpu")
    assert compile_cache.cpu_flags(shuffled) == compile_cache.cpu_flags(X86)


def test_fingerprint_falls_back_to_the_processor_name_without_flags(monkeypatch):
    monkeypatch.setattr(compile_cache, "_read_cpuinfo", lambda: "")
    monkeypatch.setattr(compile_cache.platform, "processor", lambda: "arm")
    arm = compile_cache.cpu_fingerprint()
    monkeypatch.setattr(compile_cache.platform, "processor", lambda: "i386")
    other = compile_cache.cpu_fingerprint()
    assert arm.startswith("nf-") and other.startswith("nf-") and arm != other
    monkeypatch.setattr(compile_cache.platform, "processor", lambda: "")
    assert compile_cache.cpu_fingerprint().startswith("nf-")  # still a name, never an error


def test_key_reads_this_hosts_cpuinfo(monkeypatch):
    monkeypatch.setattr(compile_cache, "_read_cpuinfo", lambda: X86)
    first = compile_cache.cache_key()
    monkeypatch.setattr(compile_cache, "_read_cpuinfo", lambda: X86.replace("avx2", "avx512f"))
    assert compile_cache.cache_key() != first


@pytest.mark.parametrize("change", [{"jax_version": "0.10.999"}, {"jaxlib_version": "0.10.999"},
                                    {"system": "darwin"}, {"machine": "aarch64"}, {"cpu": "0123456789ab"}])
def test_key_changes_with_each_input(change):
    base = dict(jax_version="0.10.2", jaxlib_version="0.10.2", system="linux", machine="x86_64", cpu="feedbeef0000")
    key = compile_cache.cache_key(**base)
    assert compile_cache.cache_key(**base) == key
    assert compile_cache.cache_key(**{**base, **change}) != key


def test_key_defaults_name_this_process():
    key = compile_cache.cache_key()
    assert f"jax{jax.__version__}" in key and sys.platform in key and compile_cache.cpu_fingerprint() in key
    assert os.sep not in key and " " not in key


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECJAX_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compile_cache.cache_root() == tmp_path / "home" / ".cache" / "specjax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_root() == tmp_path / "xdg" / "specjax"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.cache_root() == tmp_path / "mine"
    assert compile_cache.default_dir() == tmp_path / "mine" / "xla" / compile_cache.cache_key()
    assert cpu_build.cache_dir() == tmp_path / "mine" / "kernels"


def test_kernel_build_key_includes_the_cpu(monkeypatch):
    flags = ["-O3", "-march=native"]
    monkeypatch.setattr(cpu_build, "host_fingerprint", lambda: "aaaaaaaaaaaa")
    key = cpu_build.build_key("/usr/bin/g++", flags)
    assert cpu_build.build_key("/usr/bin/g++", flags) == key
    monkeypatch.setattr(cpu_build, "host_fingerprint", lambda: "bbbbbbbbbbbb")
    assert cpu_build.build_key("/usr/bin/g++", flags) != key
    assert cpu_build.build_key("/usr/bin/clang++", flags) != cpu_build.build_key("/usr/bin/g++", flags)


# ------------------------------------------------------------------------------------------------ enable()
def test_enable_sets_the_keyed_directory_and_is_idempotent(jax_cache_config, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    got = compile_cache.enable()
    assert got == str(tmp_path / "xla" / compile_cache.cache_key())
    assert os.path.isdir(got)
    assert jax.config.jax_compilation_cache_dir == got
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_TIME_SECS
    assert compile_cache.enable() == got
    assert compile_cache.enable(tmp_path / "elsewhere") == got  # JAX already has a directory: kept


def test_enable_with_a_path_keys_below_it(jax_cache_config, monkeypatch, tmp_path):
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    assert compile_cache.enable(tmp_path) == str(tmp_path / compile_cache.cache_key())


def test_users_own_cache_directory_wins(jax_cache_config, monkeypatch, tmp_path):
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    assert compile_cache.enable(tmp_path / "ours") == str(tmp_path / "users")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("value", ["0", "off", "false", "No"])
def test_env_switch_turns_it_off(jax_cache_config, monkeypatch, tmp_path, value):
    monkeypatch.setenv("SPECJAX_COMPILATION_CACHE", value)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "xla").exists()


def test_unwritable_directory_warns_once_and_continues(jax_cache_config, monkeypatch, tmp_path):
    # A path below a regular file cannot be created, even by root (who ignores permission bits).
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(blocker))
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    with pytest.warns(RuntimeWarning, match="not writable.*SPECJAX_CACHE_DIR"):
        assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cache.enable() is None  # the second call is silent


def test_load_model_turns_the_cache_on(jax_cache_config, monkeypatch, tmp_path):
    from specjax.models.loading import load_model

    cfg = tiny_config(architecture="LlamaForCausalLM")
    model = save_hf_model(tmp_path / "model", cfg, tiny_params(cfg))
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECJAX_COMPILATION_CACHE", raising=False)
    load_model(model)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache" / "xla" / compile_cache.cache_key())


# ------------------------------------------------------------------------------------------------ two processes
_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from specjax import compile_cache
if sys.argv[1] == "other-cpu":
    compile_cache.cpu_fingerprint = lambda flags=None: "0therCPU0000"
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
where = compile_cache.enable()
x = jnp.arange(48.0, dtype=jnp.float32).reshape(6, 8)  # made before counting: only `f` is counted below
events.clear()
f = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(axis=0) * 3.0 + 1.0)
print(json.dumps({"dir": where, "value": np.asarray(f(x)).tolist(),
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _child(root, mode="same"):
    env = dict(os.environ, SPECJAX_CACHE_DIR=str(root), JAX_PLATFORMS="cpu")
    env.pop("SPECJAX_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    res = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_program_from_disk(tmp_path):
    first = _child(tmp_path)
    assert first["misses"] == 1 and first["hits"] == 0, first
    files = sorted(os.listdir(first["dir"]))
    assert any(f.startswith("jit__lambda") for f in files), files
    second = _child(tmp_path)
    assert second["dir"] == first["dir"]
    assert second["hits"] == 1 and second["misses"] == 0, second
    assert second["value"] == first["value"]
    # Another CPU (same versions) gets its own directory and compiles afresh rather than reading this one.
    other = _child(tmp_path, "other-cpu")
    assert other["dir"] != first["dir"] and os.path.dirname(other["dir"]) == os.path.dirname(first["dir"])
    assert other["misses"] == 1 and other["hits"] == 0, other
