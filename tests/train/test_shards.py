"""Token shards and their manifest: round trip, crash-safe resume, and each kind of bad input a clear error."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from specjax.train.shards import (CorpusWriter, Sequence_, ShardError, iter_examples, load_shard, open_corpus,
                                  read_manifest)

HEADER = {"tokenizer": "tok-a", "target": "target-a", "seed": 0}


def _seqs(block: int, n: int = 4, vocab: int = 300) -> list[Sequence_]:
    rng = np.random.default_rng(block)
    out = []
    for i in range(n):
        rid = block * n + i
        out.append(Sequence_(rid, rid * 7, rng.integers(0, vocab, 5 + i), rng.integers(0, vocab, 3 + 2 * i),
                             0.0 if i % 2 else 1.0, 1))
    return out


def _corpus(tmp_path, blocks=(0, 1, 2)) -> str:
    root = str(tmp_path / "c")
    w = CorpusWriter(root, HEADER)
    for b in blocks:
        w.add(b, _seqs(b), 300)
    return root


def test_round_trip_keeps_every_sequence_once(tmp_path):
    root = _corpus(tmp_path)
    (c,) = open_corpus(root, tokenizer_sha="tok-a", target_sha="target-a")
    assert c.totals()["sequences"] == 12
    got = {}
    for ex in iter_examples([c], split="all", shuffle=True, seed=3):
        got[ex.prompt_id] = ex
    want = {s.prompt_id: s for b in (0, 1, 2) for s in _seqs(b)}
    assert sorted(got) == sorted(want)
    for pid, s in want.items():
        np.testing.assert_array_equal(got[pid].tokens, np.concatenate([s.prompt, s.response]))
        assert got[pid].prompt_len == s.prompt.size


def test_uint16_and_vocab_checks(tmp_path):
    w = CorpusWriter(str(tmp_path / "c"), HEADER)
    with pytest.raises(ShardError, match="uint16"):
        w.add(0, _seqs(0), 70000)
    bad = _seqs(0)
    bad[0].response[0] = 400
    with pytest.raises(ShardError, match=r"outside \[0, 300\)"):
        w.add(0, bad, 300)


def test_resume_drops_unlisted_shard_and_refuses_other_settings(tmp_path):
    root = _corpus(tmp_path, blocks=(0, 1))
    # A crash after a shard was renamed into place but before the manifest listed it leaves a stray shard.
    stray = os.path.join(root, "shard-00002.npz")
    with open(stray, "wb") as f:
        f.write(b"half a shard")
    w = CorpusWriter(root, HEADER)
    assert not os.path.exists(stray)
    assert w.done_blocks == {0, 1}
    w.add(2, _seqs(2), 300)
    assert [s["block"] for s in read_manifest(root)["shards"]] == [0, 1, 2]
    with pytest.raises(ShardError, match="already in the manifest"):
        w.add(2, _seqs(2), 300)
    with pytest.raises(ShardError, match="other settings.*seed"):
        CorpusWriter(root, dict(HEADER, seed=1))


def test_a_resume_may_change_run_settings_but_not_the_corpus_shape(tmp_path):
    """Run settings (slots, steps, a setting an older generator wrote) may differ on a resume; the prompt and
    output buckets may not."""
    root = str(tmp_path / "c")
    old = dict(HEADER, shape={"batch": 256, "prompt_len": 128, "max_new": 384, "refill": 32, "steps": 8})
    CorpusWriter(root, old).add(0, _seqs(0), 300)
    run = ("batch", "steps", "refill")
    w = CorpusWriter(root, dict(HEADER, shape={"batch": 64, "prompt_len": 128, "max_new": 384, "steps": 4}), run)
    assert w.done_blocks == {0}
    assert read_manifest(root)["shape"]["refill"] == 32  # the manifest keeps what the corpus was started with
    with pytest.raises(ShardError, match=r"other settings \(shape differ\)"):
        CorpusWriter(root, dict(HEADER, shape={"batch": 64, "prompt_len": 64, "max_new": 384, "steps": 4}), run)
    with pytest.raises(ShardError, match="other settings"):  # without run settings every key counts
        CorpusWriter(root, dict(HEADER, shape={"batch": 64, "prompt_len": 128, "max_new": 384, "steps": 4}))


def test_corrupt_shard_names_the_file(tmp_path):
    root = _corpus(tmp_path)
    path = os.path.join(root, "shard-00001.npz")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardError, match="shard-00001.npz: its SHA-256 does not match"):
        open_corpus(root)


def test_unreadable_shard_with_matching_hash_is_a_clear_error(tmp_path):
    root = _corpus(tmp_path)
    man = read_manifest(root)
    path = os.path.join(root, "shard-00000.npz")
    open(path, "wb").write(b"not a zip file")
    from specjax.train.shards import file_sha256

    entry = dict(man["shards"][0], sha256=file_sha256(path))
    with pytest.raises(ShardError, match="shard-00000.npz: not a readable shard"):
        load_shard(root, entry)


def test_lying_manifest_counts(tmp_path):
    root = _corpus(tmp_path)
    path = os.path.join(root, "manifest.json")
    man = json.load(open(path))
    man["shards"][1]["sequences"] = 5
    json.dump(man, open(path, "w"))
    (c,) = open_corpus(root)  # hashes still match: the lie is in the counts
    with pytest.raises(ShardError, match="shard-00001.npz: holds 4 sequences / .* the manifest says 5"):
        list(iter_examples([c], split="all", shuffle=False))


def test_manifest_listing_a_missing_shard(tmp_path):
    root = _corpus(tmp_path)
    os.remove(os.path.join(root, "shard-00002.npz"))
    with pytest.raises(ShardError, match="shard-00002.npz: listed in the manifest but missing"):
        open_corpus(root)


def test_other_tokenizer_or_target_is_refused(tmp_path):
    root = _corpus(tmp_path)
    with pytest.raises(ShardError, match="manifest.json: made with another tokenizer"):
        open_corpus(root, tokenizer_sha="tok-b")
    with pytest.raises(ShardError, match="manifest.json: made with another target model"):
        open_corpus(root, tokenizer_sha="tok-a", target_sha="target-b")


def test_not_a_corpus(tmp_path):
    with pytest.raises(ShardError, match="is not a token corpus"):
        open_corpus(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{\"format\": \"something else\"}")
    with pytest.raises(ShardError, match="not a specjax-token-shards/1 manifest"):
        open_corpus(str(tmp_path))


def test_heldout_split_is_by_prompt(tmp_path):
    from specjax.train.shards import is_heldout

    root = _corpus(tmp_path)
    (c,) = open_corpus(root)
    held = [e.prompt_id for e in iter_examples([c], split="heldout", shuffle=False)]
    train = [e.prompt_id for e in iter_examples([c], split="train", shuffle=False)]
    assert not set(held) & set(train) and len(held) + len(train) == 12
    assert all(is_heldout(p) for p in held) and not any(is_heldout(p) for p in train)
    ids = np.arange(20000)
    share = np.mean([is_heldout(i) for i in ids])
    assert 0.04 < share < 0.06


def test_config_fields_added_later_change_the_fingerprint_only_when_set():
    import dataclasses

    from specjax.models.llama import LlamaConfig
    from specjax.train.shards import config_identity

    base = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=8)
    cfg = LlamaConfig(**base)
    old_style = (f"LlamaConfig({', '.join(f'{k}={v!r}' for k, v in base.items())}, rms_norm_eps=1e-05, "
                 "rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=False, "
                 "attention_bias=False, architecture='llama')")
    assert config_identity(cfg) == old_style  # the repr the first corpora were hashed with
    assert config_identity(dataclasses.replace(cfg, sliding_window=64)) != old_style
    assert config_identity(dataclasses.replace(cfg, rope_theta=5e5)) != old_style


def test_a_block_range_selects_shards_and_bad_ranges_are_named(tmp_path):
    root = _corpus(tmp_path)
    (c,) = open_corpus(root, blocks="1:")
    assert [e["block"] for e in c.shards] == [1, 2]
    (c,) = open_corpus(root, blocks=":1")
    assert [e["block"] for e in c.shards] == [0]
    assert sum(1 for _ in iter_examples([c], split="all")) == 4
    for bad in ("1", "a:b", "2:1", "-1:"):
        with pytest.raises(ShardError, match="block range"):
            open_corpus(root, blocks=bad)
    with pytest.raises(ShardError, match=r"manifest.json: no shard lies in blocks 5:.*\[0, 1, 2\]"):
        open_corpus(root, blocks="5:")
