"""Write the ranked token list a trimmed draft vocabulary reads (`specjax.drafters.draft_vocab`).

    python benchmarks/draft_vocab.py --model smollm2-135m [--corpus FILE_OR_DIR ...] [--max-mb 8] [--keep 32768]

Counts the model tokenizer's ids over a text corpus and writes the `--keep` most frequent (the tokenizer's stop
and chat-control tokens first: a draft that cannot propose the end of a turn loses the last step of every answer)
to specjax/assets/draft_vocab/vocab<V>.json. The default corpus is this Python's standard library: its source
files (code, what the coder models write) and the English prose of its documentation topics. Never Spec-Bench:
it is the evaluation set. Only the tokenizer is read, not the weights.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sysconfig

import numpy as np

from specjax.drafters.draft_vocab import vocab_file


def load_tokenizer(model: str):
    from specjax.models.loading import resolve_model
    from specjax.models.tokenizer import Tokenizer

    files = resolve_model(model)
    return Tokenizer.from_gguf(files.path) if files.kind == "gguf" else Tokenizer.from_hf_dir(files.path)


def default_corpus() -> list[str]:
    lib = sysconfig.get_paths()["stdlib"]
    docs = os.path.join(lib, "pydoc_data", "topics.py")
    code = sorted(os.path.join(d, f) for d, _, fs in os.walk(lib) if "site-packages" not in d and "test" not in d
                  for f in fs if f.endswith(".py"))
    return [docs] + code


def texts(paths: list[str], max_bytes: int):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs)
        else:
            files.append(p)
    total = 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                t = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        yield t
        total += len(t)
        if total >= max_bytes:
            return


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", nargs="*", default=None)
    ap.add_argument("--max-mb", type=float, default=8.0)
    ap.add_argument("--keep", type=int, default=32768)
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the model's vocabulary (embedding rows) when it exceeds the tokenizer's (Qwen2.5: 151936)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.model)
    V = a.vocab_size or tok.vocab_size
    counts = collections.Counter()
    n_bytes = 0
    for t in texts(a.corpus or default_corpus(), int(a.max_mb * 2 ** 20)):
        counts.update(tok.encode(t))
        n_bytes += len(t)
    first = [i for i in dict.fromkeys(list(tok.stop_token_ids) + [tok.token_to_id(s) for s in
                                                                     ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
             if i is not None and 0 <= i < V]
    ranked = first + [i for i, _ in counts.most_common() if i not in first]
    # Ids never seen in the corpus follow in id order (BPE merge order: earlier merges were more frequent).
    seen = set(ranked)
    ranked += [i for i in range(V) if i not in seen][:max(0, a.keep - len(ranked))]
    ranked = ranked[:min(a.keep, V)]
    mass = sum(counts[i] for i in ranked) / max(1, sum(counts.values()))
    out = a.out or vocab_file(V)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {"vocab_size": V, "tokenizer": a.model, "corpus": "custom" if a.corpus else "python stdlib source + "
            "pydoc topics", "corpus_bytes": n_bytes, "corpus_tokens": int(sum(counts.values())),
            "ids": [int(i) for i in np.asarray(ranked)]}
    with open(out, "w") as f:
        json.dump(meta, f, separators=(",", ":"))
    print(f"{out}: {len(ranked)} of {V} ids ranked from {meta['corpus_tokens']} tokens ({n_bytes / 2**20:.1f} MB); "
          f"they cover {mass:.4f} of the corpus tokens")
    for n in (1024, 4096, 8192, 16384, 32768):
        if n <= len(ranked):
            print(f"  top {n}: {sum(counts[i] for i in ranked[:n]) / max(1, sum(counts.values())):.4f} of tokens")


if __name__ == "__main__":
    main()
