"""Token shards: the distillation corpus as compact uint16 shards with a manifest, and the streaming loader.

A corpus is a directory:

    manifest.json           format, tokenizer and target fingerprints, the generation settings, one entry per shard
    shard-00000.npz ...     one block of requests each (numpy .npz, no pickles):
        tokens       [T] uint16    every sequence (prompt then response) concatenated
        offsets      [n + 1] int64 sequence i is tokens[offsets[i]:offsets[i + 1]]
        prompt_len   [n] int32     tokens of the chat-formatted prompt (the rest is the target's response)
        request      [n] int64     request id (stable across runs: the plan is deterministic)
        prompt_id    [n] int64     the prompt's id; the held-out split is a function of it
        temperature  [n] float32   0 = greedy
        finish       [n] uint8     1 = stop token, 2 = length limit
    features/shard-00000.bf16   optional: the target's features at every token, [T, F] bfloat16, memory-mapped

Writing is crash-safe: a shard is written to a temporary name, fsynced and renamed, then the manifest is
rewritten the same way; a shard that the manifest does not list is an unfinished one and is written again. So a
run killed at any point loses at most the blocks in flight and never lists a shard twice.

Reading checks what it can before training starts: the manifest's format, tokenizer and target against the
caller's, every listed shard's existence, size and SHA-256, and each shard's arrays against its manifest entry.
Each problem is a `ShardError` naming the file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np

from specjax.errors import SpecjaxError

FORMAT = "specjax-token-shards/1"
MANIFEST = "manifest.json"
SHARD_FIELDS = ("tokens", "offsets", "prompt_len", "request", "prompt_id", "temperature", "finish")
FINISH_STOP, FINISH_LENGTH = 1, 2


class ShardError(SpecjaxError, ValueError):
    """A token shard, its features or the corpus manifest is missing, corrupt or made for another model."""


# ------------------------------------------------------------------------------------------------- identity


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of the tokenizer's serialized form: shards made with another tokenizer do not match."""
    return hashlib.sha256(tokenizer.to_json().encode()).hexdigest()


# The config fields the first corpora were fingerprinted with. A field added to the config class later enters the
# hash only when it differs from its default, so a growing config class keeps every existing corpus's identity.
_FINGERPRINT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                       "tie_word_embeddings", "attention_bias", "architecture")


def config_identity(config) -> str:
    """The text a config contributes to `target_fingerprint`: a dataclass repr of the original fields, then the
    later ones that differ from their defaults."""
    import dataclasses

    parts = [f"{n}={getattr(config, n)!r}" for n in _FINGERPRINT_FIELDS]
    for f in dataclasses.fields(config):
        if f.name not in _FINGERPRINT_FIELDS and getattr(config, f.name) != f.default:
            parts.append(f"{f.name}={getattr(config, f.name)!r}")
    return f"{type(config).__name__}({', '.join(parts)})"


def target_fingerprint(config, params) -> str:
    """A cheap identity of the target's weights: its config (`config_identity`) and a strided sample of every
    tensor (hashing all 135M parameters would cost more than it protects against)."""
    import jax

    h = hashlib.sha256(config_identity(config).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda kv: str(kv[0])):
        flat = np.asarray(leaf, np.float32).reshape(-1)
        h.update(str(path).encode())
        h.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).tobytes())
    return h.hexdigest()[:32]


def is_heldout(prompt_id: int, every: int = 20) -> bool:
    """The evaluation split: a prompt is held out by its id alone, so every answer to it is held out too."""
    return (int(prompt_id) * 2654435761) % (1 << 32) % every == 0


# ------------------------------------------------------------------------------------------------- writing


def _atomic_write(path: str, write) -> None:
    """write(fileobj) into a temporary file beside `path`, fsync, rename over `path`."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a corpus is meant to be shared and committed
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@dataclasses.dataclass
class Sequence_:
    """One finished request: ids, its tokens (prompt then response) and, optionally, features [len, F]."""

    request: int
    prompt_id: int
    prompt: np.ndarray  # [P] int
    response: np.ndarray  # [R] int
    temperature: float
    finish: int
    features: np.ndarray | None = None  # [P + R, F] bfloat16, one row per token (a teacher-forced forward)


def pack_shard(seqs: Sequence[Sequence_], vocab_size: int) -> dict[str, np.ndarray]:
    if vocab_size > 65536:
        raise ShardError(f"a vocabulary of {vocab_size} ids does not fit uint16 shards")
    seqs = sorted(seqs, key=lambda s: s.request)
    parts = [np.concatenate([s.prompt, s.response]).astype(np.int64) for s in seqs]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ShardError(f"token ids outside [0, {vocab_size}) cannot go into a shard")
    return {
        "tokens": tokens.astype(np.uint16),
        "offsets": np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64),
        "prompt_len": np.asarray([s.prompt.size for s in seqs], np.int32),
        "request": np.asarray([s.request for s in seqs], np.int64),
        "prompt_id": np.asarray([s.prompt_id for s in seqs], np.int64),
        "temperature": np.asarray([s.temperature for s in seqs], np.float32),
        "finish": np.asarray([s.finish for s in seqs], np.uint8),
    }


def _corpus_part(header: dict, run_settings: tuple[str, ...]) -> dict:
    """The header without its run settings (`CorpusWriter`)."""
    if not run_settings or not isinstance(header.get("shape"), dict):
        return header
    return dict(header, shape={k: v for k, v in header["shape"].items() if k not in run_settings})


class CorpusWriter:
    """Appends shards to a corpus directory and keeps its manifest; reopening an existing corpus resumes it.

    header: what the corpus is (tokenizer and target fingerprints, generation settings, feature layout); a
    corpus started with another header is refused rather than mixed. run_settings: the header's keys under "shape"
    that say how a run went, not what the corpus is (batch size, steps per check-in): a resume may change them, and
    a manifest may hold ones this version no longer writes.
    """

    def __init__(self, root: str, header: dict, run_settings: tuple[str, ...] = ()):
        self.root = root
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, MANIFEST)
        header = json.loads(json.dumps(dict(header, format=FORMAT)))
        if os.path.exists(path):
            man = read_manifest(root)
            old = {k: v for k, v in man.items() if k != "shards"}
            was, now = _corpus_part(old, run_settings), _corpus_part(header, run_settings)
            if was != now:
                diff = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
                raise ShardError(f"{path}: this corpus was made with other settings ({', '.join(diff)} differ); "
                                 "use another --out directory or the settings it was made with")
            self.manifest = man
        else:
            self.manifest = dict(header, shards=[])
            self._write_manifest()
        # Shard files the manifest does not list were cut off by a crash: they are written again.
        listed = {s["file"] for s in self.manifest["shards"]}
        for name in os.listdir(root):
            if name.startswith("shard-") and name not in listed:
                os.remove(os.path.join(root, name))

    @property
    def done_blocks(self) -> set[int]:
        return {s["block"] for s in self.manifest["shards"]}

    def add(self, block: int, seqs: Sequence[Sequence_], vocab_size: int, feature_width: int = 0) -> dict:
        """Write block `block`'s sequences as one shard (and its features) and list it in the manifest."""
        if block in self.done_blocks:
            raise ShardError(f"{self.root}: block {block} is already in the manifest")
        arrays = pack_shard(seqs, vocab_size)
        name = f"shard-{block:05d}.npz"
        path = os.path.join(self.root, name)
        entry = {"file": name, "block": block, "sequences": int(arrays["request"].size),
                 "tokens": int(arrays["tokens"].size),
                 "response_tokens": int(arrays["tokens"].size - arrays["prompt_len"].sum())}
        if feature_width:
            fdir = os.path.join(self.root, "features")
            os.makedirs(fdir, exist_ok=True)
            feats = np.concatenate([s.features for s in sorted(seqs, key=lambda s: s.request)])
            if feats.shape != (arrays["tokens"].size, feature_width):
                raise ShardError(f"block {block}: features {feats.shape} do not match {arrays['tokens'].size} tokens "
                                 f"x {feature_width}")
            fname = f"shard-{block:05d}.bf16"
            _atomic_write(os.path.join(fdir, fname), lambda f: f.write(np.ascontiguousarray(feats).tobytes()))
            entry["features"] = fname
        _atomic_write(path, lambda f: np.savez(f, **arrays))
        entry["sha256"] = file_sha256(path)
        self.manifest["shards"].append(entry)
        self.manifest["shards"].sort(key=lambda s: s["block"])
        self._write_manifest()
        return entry

    def _write_manifest(self) -> None:
        text = json.dumps(self.manifest, indent=1, sort_keys=True).encode()
        _atomic_write(os.path.join(self.root, MANIFEST), lambda f: f.write(text))


# ------------------------------------------------------------------------------------------------- reading


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise ShardError(f"{path} does not exist: {root!r} is not a token corpus (make one with "
                         "`python -m specjax.train.generate --out DIR`)")
    try:
        with open(path) as f:
            man = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: not a readable JSON manifest ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("shards"), list):
        raise ShardError(f"{path}: not a {FORMAT} manifest (format {man.get('format') if isinstance(man, dict) else None!r})")
    return man


def load_shard(root: str, entry: dict, check_hash: bool = True) -> dict[str, np.ndarray]:
    """One shard's arrays, checked against its manifest entry (hash, fields, counts, offsets)."""
    path = os.path.join(root, entry["file"])
    if not os.path.isfile(path):
        raise ShardError(f"{path}: listed in the manifest but missing; regenerate it (rerun the generation command)")
    if check_hash and file_sha256(path) != entry.get("sha256"):
        raise ShardError(f"{path}: its SHA-256 does not match the manifest (corrupt or replaced); delete it and "
                         "its manifest entry, then rerun the generation command")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # zipfile, numpy and OS errors all mean one thing here: the file is not a shard
        raise ShardError(f"{path}: not a readable shard ({type(e).__name__}: {e})") from None
    missing = [k for k in SHARD_FIELDS if k not in arrays]
    if missing:
        raise ShardError(f"{path}: fields {missing} are missing")
    n, off = arrays["request"].size, arrays["offsets"]
    if (arrays["tokens"].dtype != np.uint16 or off.size != n + 1 or off[0] != 0 or off[-1] != arrays["tokens"].size
            or np.any(np.diff(off) <= 0) or np.any(arrays["prompt_len"] >= np.diff(off))
            or any(arrays[k].size != n for k in ("prompt_len", "prompt_id", "temperature", "finish"))):
        raise ShardError(f"{path}: inconsistent arrays (offsets, lengths or dtypes)")
    if n != entry.get("sequences") or arrays["tokens"].size != entry.get("tokens"):
        raise ShardError(f"{path}: holds {n} sequences / {arrays['tokens'].size} tokens, the manifest says "
                         f"{entry.get('sequences')} / {entry.get('tokens')}")
    return arrays


def shard_features(root: str, entry: dict, width: int) -> np.ndarray:
    """The shard's feature file as a read-only memory map [T, width] bfloat16."""
    import ml_dtypes

    if "features" not in entry:
        raise ShardError(f"{os.path.join(root, entry['file'])}: this corpus was generated without features; "
                         "train with online features (the default) or regenerate with --features")
    path = os.path.join(root, "features", entry["features"])
    expect = entry["tokens"] * width * 2
    if not os.path.isfile(path) or os.path.getsize(path) != expect:
        have = os.path.getsize(path) if os.path.isfile(path) else "no"
        raise ShardError(f"{path}: expected {expect} bytes ({entry['tokens']} tokens x {width} bfloat16), found "
                         f"{have} bytes")
    return np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(entry["tokens"], width))


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A checked corpus: its root, manifest and which shards to read."""

    root: str
    manifest: dict

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def feature_width(self) -> int:
        return int(self.manifest.get("feature_width", 0))

    def totals(self) -> dict:
        s = self.shards
        return {"shards": len(s), "sequences": sum(e["sequences"] for e in s), "tokens": sum(e["tokens"] for e in s),
                "response_tokens": sum(e["response_tokens"] for e in s)}


def parse_blocks(spec: str | None) -> tuple[int, int | None] | None:
    """A block range "A:B" (blocks A..B-1), "A:" or ":B" as (start, end or None); None or "" = every block."""
    if not spec:
        return None
    a, sep, b = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = int(a) if a.strip() else 0, int(b) if b.strip() else None
    except ValueError:
        raise ShardError(f"block range {spec!r}: write START:END, START: or :END with whole numbers "
                         "(blocks START..END-1)") from None
    if lo < 0 or (hi is not None and hi <= lo):
        raise ShardError(f"block range {spec!r} selects no block: START must be >= 0 and END > START")
    return lo, hi


def open_corpus(roots: str | Sequence[str], *, tokenizer_sha: str | None = None, target_sha: str | None = None,
                check_hashes: bool = True, blocks: str | None = None) -> list[Corpus]:
    """Open one or more corpus directories and check them against the tokenizer and target that will use them.

    blocks: "A:B" keeps only the shards of blocks A..B-1 (`parse_blocks`), e.g. the blocks whose features this
    machine recorded; a range that selects no shard of a corpus is an error naming it."""
    out = []
    rng = parse_blocks(blocks)
    for root in [roots] if isinstance(roots, str) else roots:
        man = read_manifest(root)
        where = os.path.join(root, MANIFEST)
        if rng is not None:
            lo, hi = rng
            man = dict(man, shards=[e for e in man["shards"] if lo <= e["block"] and (hi is None or e["block"] < hi)])
            if not man["shards"]:
                raise ShardError(f"{where}: no shard lies in blocks {blocks} (it holds blocks "
                                 f"{sorted(e['block'] for e in read_manifest(root)['shards'])})")
        if tokenizer_sha and man.get("tokenizer") != tokenizer_sha:
            raise ShardError(f"{where}: made with another tokenizer ({str(man.get('tokenizer'))[:12]}..., this model's "
                             f"is {tokenizer_sha[:12]}...); its token ids mean other words")
        if target_sha and man.get("target") != target_sha:
            raise ShardError(f"{where}: made with another target model ({str(man.get('target'))[:12]}..., this one is "
                             f"{target_sha[:12]}...); heads must learn from their own target's answers")
        for e in man["shards"]:
            path = os.path.join(root, e.get("file", "?"))
            if not os.path.isfile(path):
                raise ShardError(f"{path}: listed in the manifest but missing")
            if check_hashes and file_sha256(path) != e.get("sha256"):
                raise ShardError(f"{path}: its SHA-256 does not match the manifest (corrupt or replaced)")
        out.append(Corpus(root, man))
    return out


@dataclasses.dataclass(frozen=True)
class Example:
    """One sequence as the loader yields it."""

    tokens: np.ndarray  # [L] int32
    prompt_len: int
    prompt_id: int
    temperature: float
    features: np.ndarray | None  # [L, F] bfloat16 view into the memory map, or None


def iter_examples(corpora: Sequence[Corpus], *, split: str = "train", seed: int = 0, epoch: int = 0,
                  features: bool = False, shuffle: bool = True) -> Iterator[Example]:
    """Stream the sequences of every shard, one shard in memory at a time; split is "train", "heldout" or "all".

    With shuffle the shard order and the order inside each shard are permuted by (seed, epoch): a fixed seed
    gives the same stream on every run, so a resumed training run sees the batches it would have seen.
    """
    if split not in ("train", "heldout", "all"):
        raise ShardError(f"split must be 'train', 'heldout' or 'all', not {split!r}")
    work = [(c, e) for c in corpora for e in c.shards]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(work)) if shuffle else np.arange(len(work))
    for w in order:
        c, e = work[w]
        a = load_shard(c.root, e, check_hash=False)
        fm = shard_features(c.root, e, c.feature_width) if features else None
        off = a["offsets"]
        held = np.asarray([is_heldout(p) for p in a["prompt_id"]], bool)
        keep = np.flatnonzero(held if split == "heldout" else ~held if split == "train" else np.ones_like(held))
        if shuffle:
            keep = rng.permutation(keep)
        for i in keep:
            s, t = int(off[i]), int(off[i + 1])
            yield Example(a["tokens"][s:t].astype(np.int32), int(a["prompt_len"][i]), int(a["prompt_id"][i]),
                          float(a["temperature"][i]), None if fm is None else fm[s:t])
