"""Trimmed draft vocabularies: target token ids ranked by how often they occur in generated text, one list per
tokenizer, shipped in `specjax/assets/draft_vocab/vocab<V>.json` and keyed by the vocabulary size.

A draft model whose LM head keeps only the N first ids of the list (`draft_model.trim_vocab`) reads N x H head
weights a token instead of V x H, and its q is zero on every other token; acceptance stays exact because it uses
the q the draft sampled from. The lists are written by `benchmarks/draft_vocab.py` (token counts over a text
corpus, the tokenizer's stop tokens first); the file records which tokenizer and corpus.
"""
from __future__ import annotations

import json
import os

import numpy as np

from specjax.errors import SpecjaxError

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "draft_vocab")


class DraftVocabError(SpecjaxError, ValueError):
    """No ranked id list fits this vocabulary, or the request asks for more ids than it holds."""


def vocab_file(vocab_size: int) -> str:
    return os.path.join(ASSET_DIR, f"vocab{int(vocab_size)}.json")


def ranked_ids(vocab_size: int, n: int) -> np.ndarray:
    """The n most frequent target ids [n] int32 for a vocabulary of `vocab_size` tokens (most frequent first)."""
    path = vocab_file(vocab_size)
    if not os.path.isfile(path):
        have = sorted(f for f in os.listdir(ASSET_DIR) if f.endswith(".json")) if os.path.isdir(ASSET_DIR) else []
        raise DraftVocabError(f"draft_vocab_size needs a ranked token list for a {vocab_size}-token vocabulary "
                              f"({path} is missing; shipped: {', '.join(have) or 'none'}); write one with "
                              "benchmarks/draft_vocab.py, or set draft_vocab_size: 0")
    with open(path) as f:
        data = json.load(f)
    ids = np.asarray(data["ids"], np.int64)
    if data.get("vocab_size") != vocab_size or ids.ndim != 1 or ids.min() < 0 or ids.max() >= vocab_size:
        raise DraftVocabError(f"{path}: not a ranked id list for a {vocab_size}-token vocabulary")
    if not 1 <= n <= ids.size:
        raise DraftVocabError(f"draft_vocab_size={n}: the ranked list for this vocabulary holds {ids.size} ids "
                              f"({data.get('tokenizer', '?')}); use 1..{ids.size}, or 0 for the whole vocabulary")
    return ids[:n].astype(np.int32)
