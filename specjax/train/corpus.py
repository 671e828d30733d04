"""Training batches from token shards: the streaming loader, the target's soft targets on device, online features.

A head trainer reads a corpus (`specjax.train.shards`) through `CorpusBatches`: shards are read one at a time in
a seeded order, sequences are cut to `max_len`, grouped into batches of similar length from a pool of shuffled
sequences, and padded to a multiple of `bucket`. Batch k of the stream is a pure function of (seed, k), so a
resumed run sees the batches an uninterrupted one would have seen.

Features either come from the corpus (recorded during generation, bfloat16 memory maps) or are computed online,
inside the jitted target step, by the target's forward without gradient (`device_targets`). The soft targets
are the target's own distribution at each position, from the final feature through its LM head: the top-k
restricted to the head's vocabulary, the greedy token, and the mask of response positions.

The run helpers at the end are what every corpus trainer (`eagle`, `draft_model`, `medusa`) does the same way:
open the corpus against the target, guard a resumed run against a changed corpus, choose the output vocabulary
from the training split's counts, and cut the greedy held-out batches.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train.shards import Corpus, Example, ShardError, iter_examples


def truncated(ex: Example, max_len: int) -> Example | None:
    """The example cut to max_len tokens, or None if no response token is left."""
    if max_len and ex.tokens.size > max_len:
        if ex.prompt_len >= max_len - 1:
            return None
        return Example(ex.tokens[:max_len], ex.prompt_len, ex.prompt_id, ex.temperature,
                       None if ex.features is None else ex.features[:max_len])
    return ex


class CorpusBatches:
    """Deterministic batches over one split of the corpora.

    batch_at(k) -> dict of host arrays: tokens [B, T] int32, prompt_len [B] int32, length [B] int32 (0 for a
    padding row), temperature [B] float32 and with features feats [B, T, F] bfloat16 (zero past each length).
    T is the batch's longest sequence rounded up to `bucket`. Sequential calls stream; a jump back (a resumed
    run) replays the stream from the start of its epoch.
    """

    def __init__(self, corpora: Sequence[Corpus], *, batch: int, bucket: int, max_len: int, seed: int,
                 split: str = "train", features: bool = False, pool: int = 64):
        self.corpora, self.batch, self.bucket, self.max_len = list(corpora), batch, bucket, max_len
        self.seed, self.split, self.features, self.pool = seed, split, features, pool
        self._it: Iterator[dict] | None = None
        self._next = 0
        if not any(c.shards for c in self.corpora):
            raise ShardError(f"{', '.join(c.root for c in self.corpora)}: the corpus holds no shards yet")

    def _epoch(self, epoch: int) -> Iterator[dict]:
        rng = np.random.default_rng([self.seed, epoch, 1])
        buf: list[Example] = []
        stream = iter_examples(self.corpora, split=self.split, seed=self.seed, epoch=epoch, features=self.features,
                               shuffle=True)

        def flush(items: list[Example]):
            items = sorted(items, key=lambda e: e.tokens.size)
            groups = [items[s:s + self.batch] for s in range(0, len(items), self.batch)]
            for g in (groups[i] for i in rng.permutation(len(groups))):
                yield self._pack(g)

        for ex in stream:
            ex = truncated(ex, self.max_len)
            if ex is None:
                continue
            buf.append(ex)
            if len(buf) == self.pool * self.batch:
                yield from flush(buf)
                buf = []
        if buf:
            yield from flush(buf)

    def _pack(self, group: list[Example]) -> dict:
        B = self.batch
        T = -(-max(e.tokens.size for e in group) // self.bucket) * self.bucket
        out = {"tokens": np.zeros((B, T), np.int32), "prompt_len": np.zeros(B, np.int32),
               "length": np.zeros(B, np.int32), "temperature": np.zeros(B, np.float32)}
        if self.features:
            import ml_dtypes

            out["feats"] = np.zeros((B, T, group[0].features.shape[1]), ml_dtypes.bfloat16)
        for i, e in enumerate(group):
            n = e.tokens.size
            out["tokens"][i, :n], out["prompt_len"][i], out["length"][i] = e.tokens, e.prompt_len, n
            out["temperature"][i] = e.temperature
            if self.features:
                out["feats"][i, :n] = e.features
        return out

    def epochs(self) -> Iterator[dict]:
        epoch = 0
        while True:
            n = 0
            for b in self._epoch(epoch):
                n += 1
                yield b
            if n == 0:
                raise ShardError(f"split {self.split!r} of the corpus is empty")
            epoch += 1

    def batch_at(self, k: int) -> dict:
        if self._it is None or k < self._next:
            self._it, self._next = self.epochs(), 0
        while self._next < k:
            next(self._it)
            self._next += 1
        self._next += 1
        return next(self._it)


def count_tokens(corpora: Sequence[Corpus], vocab_size: int, split: str = "train") -> np.ndarray:
    """How often each id appears as a response token of the split [V] int64."""
    counts = np.zeros(vocab_size, np.int64)
    for ex in iter_examples(corpora, split=split, shuffle=False):
        counts += np.bincount(ex.tokens[ex.prompt_len:], minlength=vocab_size)
    return counts


def vocab_from_counts(counts: np.ndarray, size: int, always: Sequence[int]) -> np.ndarray:
    """The `size` most frequent ids (ties by id; `always` kept whatever their count), ascending."""
    score = counts.astype(np.float64)
    score[list(always)] = np.inf
    order = np.lexsort((np.arange(counts.size), -score))
    return np.sort(order[:size]).astype(np.int32)


def coverage(train_counts: np.ndarray, heldout_counts: np.ndarray, sizes: Sequence[int],
             always: Sequence[int]) -> dict[int, float]:
    """Share of the held-out response tokens inside the draft vocabulary chosen on the training split."""
    total = max(int(heldout_counts.sum()), 1)
    return {int(s): float(heldout_counts[vocab_from_counts(train_counts, s, always)].sum() / total) for s in sizes}


@functools.partial(jax.jit, static_argnames=("tcfg", "layers", "top_k", "online"))
def device_targets(tparams: dict, tcfg, batch: dict, out_ids: jax.Array, t2o: jax.Array, *, layers: tuple,
                   top_k: int, online: bool):
    """The head's training inputs from a corpus batch, on device, without gradient.

    batch: tokens [B, T], prompt_len [B], length [B], temperature [B] and (recorded features) feats
    [B, T, (1 + len(layers)) * H] laid out [final | layer outputs]. online: compute the features with the target's
    forward instead. out_ids [Vo] int32: the head's output vocabulary as target ids; t2o [V] int32 its inverse
    (-1 outside). Returns tokens, final [B, T, H] float32, layers [B, T, len(layers) * H] float32, soft_idx /
    soft_p [B, T, K] (at position p the target's distribution of token p + 1 inside the head vocabulary: its
    top-k there, renormalised), greedy [B, T] (head index of the target's greedy token, -1 outside the head
    vocabulary) and mask [B, T] (p predicts a response token).

    Only the head vocabulary's columns of the target's LM head are computed (a top-k over the full 49k-wide
    vocabulary costs more than the head's own step). The greedy token is the next token itself on greedy
    answers (what the target chose); on sampled answers it is the head-vocabulary argmax, which is the target's
    argmax whenever that lies inside the head vocabulary.
    """
    from specjax.train.features import target_features

    tokens = batch["tokens"]
    H = tcfg.hidden_size
    if online:
        final, lay = target_features(tparams, tcfg, tokens, layers)
    else:
        f = batch["feats"].astype(jnp.float32)
        final, lay = f[..., :H], f[..., H:]
    final, lay = jax.lax.stop_gradient(final), jax.lax.stop_gradient(lay)
    head = tparams["lm_head"] if "lm_head" in tparams else tparams["embed"].T  # [H, V]
    logp = jax.nn.log_softmax(final @ jnp.take(head, out_ids, axis=1), axis=-1)  # [B, T, Vo]
    top_lp, idx = jax.lax.top_k(logp, top_k)
    T = tokens.shape[1]
    pos = jnp.arange(T)[None, :]
    # Position p predicts token p + 1; the loss covers the predictions of response tokens only.
    mask = (pos >= batch["prompt_len"][:, None] - 1) & (pos < batch["length"][:, None] - 1)
    p = jnp.exp(top_lp) * mask[..., None]
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    nxt = t2o[jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)]
    greedy = jnp.where(batch["temperature"][:, None] == 0, nxt, idx[..., 0])
    greedy = jnp.where(mask, greedy, -1)
    return {"tokens": tokens, "final": final, "layers": lay, "soft_idx": idx.astype(jnp.int32), "soft_p": p,
            "greedy": greedy.astype(jnp.int32), "mask": mask}


def t2o_table(vocab_size: int, out_ids: np.ndarray | None) -> np.ndarray:
    """target id -> head vocabulary index [V] int32 (-1 outside); None = the full vocabulary."""
    if out_ids is None:
        return np.arange(vocab_size, dtype=np.int32)
    t = np.full(vocab_size, -1, np.int32)
    t[out_ids] = np.arange(out_ids.size, dtype=np.int32)
    return t


# ------------------------------------------------------------------------------------------------- run helpers
SOFT_TOP_K = 16  # entries of the target's distribution kept as soft targets at each position


def open_for_target(roots: Sequence[str], target, blocks: str | None = None) -> list[Corpus]:
    """The corpora at `roots` (only blocks `blocks`, "A:B", if given), checked against a loaded target
    (`specjax.models.loading.load_model` with its tokenizer): a corpus made with another tokenizer or another
    target's weights is refused (`ShardError`)."""
    from specjax.train.shards import open_corpus, target_fingerprint, tokenizer_fingerprint

    return open_corpus(roots, tokenizer_sha=tokenizer_fingerprint(target.tokenizer),
                       target_sha=target_fingerprint(target.config, target.params), blocks=blocks)


def recorded_features(corpora: Sequence[Corpus], layout: Sequence[str] | None = None) -> bool:
    """Whether every corpus recorded features (laid out as `layout`, e.g. ["final", "1", "14", "26"]; None =
    any) and every shard's feature file is here at its full size: a committed corpus lists its features in the
    manifest but keeps the files local, so only the machine that generated it can read them."""
    for c in corpora:
        if not c.feature_width or (layout is not None and c.manifest.get("features") != list(layout)):
            return False
        for e in c.shards:
            path = os.path.join(c.root, "features", e.get("features", ""))
            size = e["tokens"] * c.feature_width * 2  # bfloat16
            if "features" not in e or not os.path.isfile(path) or os.path.getsize(path) != size:
                return False
    return True


def shard_hashes(roots: Sequence[str], blocks: str | None = None) -> list[str]:
    """One short hash per corpus over its listed (and, with `blocks`, selected) shards' SHA-256s, for a run's
    settings guard (`check_run`): a corpus that grew or changed since the run started would change the batch
    stream under a resumed run."""
    import hashlib

    from specjax.train.shards import open_corpus

    return [hashlib.sha256("".join(e["sha256"] for e in c.shards).encode()).hexdigest()[:16]
            for c in open_corpus(roots, check_hashes=False, blocks=blocks)]


def add_corpus_blocks_arg(ap) -> None:
    """The `--corpus-blocks` option every corpus trainer takes."""
    ap.add_argument("--corpus-blocks", default=None, metavar="A:B",
                    help="--corpus: train and evaluate on blocks A..B-1 only (A: = from A on), e.g. the blocks "
                         "whose features this machine recorded")


def tokenizer_always_ids(tokenizer) -> list[int]:
    """Ids every output vocabulary keeps: the first three specials and the tokenizer's stop tokens (the corpus
    counterpart of `specjax.train.common.always_ids`, which reads them from an .npz's metadata)."""
    return sorted({0, 1, 2, *tokenizer.stop_token_ids})


def train_vocab(corpora: Sequence[Corpus], size: int, vocab_size: int, always: Sequence[int], counts_path: str,
                what: str = "--draft-vocab", error: type[Exception] | None = None) -> np.ndarray:
    """The `size` most frequent response ids of the training split [size] int32, ascending (`vocab_from_counts`).

    The counts are kept in counts_path (.npy): counting reads every shard once, and a resumed run keeps them.
    what: how the error names `size`; error: the exception class raised for a size outside [len(always), V]
    (default `specjax.train.common.TrainError`)."""
    from specjax.train.common import TrainError, cached_array

    if not len(always) <= size <= vocab_size:
        raise (error or TrainError)(f"{what} {size} must lie in [{len(always)}, {vocab_size}] (the target's "
                                    "vocabulary, at least the special and stop tokens)")
    counts = cached_array(counts_path, lambda: count_tokens(corpora, vocab_size, "train"))
    return vocab_from_counts(counts, size, always)


def heldout_batches(corpora: Sequence[Corpus], *, batch: int, bucket: int, max_len: int, limit: int,
                    features: bool = False) -> Iterator[dict]:
    """Up to `limit` batches of the held-out split (the `CorpusBatches` layout, seed 0, first epoch), with the
    sampled answers' lengths set to 0 so only greedy answers are scored: on greedy text a teacher-forced match
    is exactly what speculation would get accepted. A generator: one batch (and its features) in memory at a time."""
    held = CorpusBatches(corpora, batch=batch, bucket=bucket, max_len=max_len, seed=0, split="heldout",
                         features=features)
    for _, hb in zip(range(limit), held._epoch(0)):
        yield dict(hb, length=np.where(hb["temperature"] == 0, hb["length"], 0).astype(np.int32))


def shifted(a: jax.Array, by: int, fill=0) -> jax.Array:
    """a[:, t + by] at row t along axis 1 ([B, T, ...] -> same shape), `fill` past the end."""
    pad = jnp.full((a.shape[0], by) + a.shape[2:], fill, a.dtype)
    return jnp.concatenate([a[:, by:], pad], axis=1)
