"""Draft vocabulary by measurement: coverage of the target's held-out response tokens against the EAGLE-3 head's
step cost, for 4k / 8k / 16k / 32k draft vocabularies.

    python reports/heads_at_scale/vocab_cost.py data/smollm2-135m/responses > reports/heads_at_scale/vocab_cost.json

Coverage: the share of held-out response tokens inside the V most frequent training response tokens (a draft
token outside the draft vocabulary can never be proposed). Cost: one propose of a 1-token and a 4-token chain
(1 and 4 head steps) after a 256-token prompt, over one plain decode step of the target, both timed here in one
process, plain first and last. Heads are built at each size from the target (their weights do not change the
cost). Run it with nothing else on the machine.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import numpy as np


def main(corpus_root: str) -> dict:
    from specjax.api import LLM
    from specjax.config import SamplingParams, SpeculativeConfig
    from specjax.heads.eagle import head_config, init_from_target
    from specjax.heads.eagle_io import save_head
    from specjax.tools.tune import measure_draft_cost, measure_loop_costs
    from specjax.train.corpus import count_tokens, coverage, vocab_from_counts
    from specjax.train.shards import open_corpus

    from specjax.models.loading import load_model

    llm = LLM("smollm2-135m")
    tok = llm.tokenizer
    target_params = load_model("smollm2-135m", with_tokenizer=False).params  # unfused: what heads start from
    corpora = open_corpus(corpus_root, check_hashes=False)
    V = llm.config.vocab_size
    always = sorted({0, 1, 2, *tok.stop_token_ids})
    train, held = count_tokens(corpora, V, "train"), count_tokens(corpora, V, "heldout")
    sizes = (4096, 8192, 16384, 32768)
    cov = coverage(train, held, sizes + (V,), always)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain how tides work. " * 30}]))[:256]
    sp = SamplingParams(max_new_tokens=48, temperature=0.0)
    plain_prompts = [prompt]
    t0 = time.time()
    plain_first = measure_loop_costs(llm, {}, plain_prompts, sp).plain_s
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            cfg = head_config(llm.config, "eagle3", draft_vocab_size=size)
            params = init_from_target(cfg, target_params, -1, draft_ids=vocab_from_counts(train, size, always))
            path = f"{d}/h{size}"
            save_head(path, cfg, params)
            chain = lambda g: SpeculativeConfig(method="eagle3", model=path, num_speculative_tokens=g, top_k=1,
                                                depth=g, total_tokens=g)
            one, four = measure_draft_cost(llm, chain(1), prompt), measure_draft_cost(llm, chain(4), prompt)
            rows[size] = {"coverage": cov[size], "propose_1_s": one, "propose_4_s": four}
    plain_last = measure_loop_costs(llm, {}, plain_prompts, sp).plain_s
    plain = float(np.median([plain_first, plain_last]))
    for r in rows.values():
        r["head_step_in_target_steps"] = r["propose_1_s"] / plain
        r["four_steps_in_target_steps"] = r["propose_4_s"] / plain
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "corpus": corpus_root, "plain_step_s": {"first": plain_first, "last": plain_last},
            "drift": abs(plain_last - plain_first) / plain_first, "full_vocab_coverage": cov[V],
            "heldout_tokens": int(held.sum()), "train_tokens": int(train.sum()), "sizes": rows,
            "seconds": time.time() - t0}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "data/smollm2-135m/responses"), indent=1))
