# Evidence (reports/README.md): ran at commit 2538579, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=2538579 p=reports/decode_cpu/read_ceiling/step_ms.py
"""Median step time of plain greedy decoding (SmolLM2-135M float32, batch 1, 256 new tokens, the on-device loop,
prefill excluded): 3 timed loops after one that compiles."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.api import LLM, pad_prompts
from specjax.config import SamplingParams

llm = LLM("smollm2-135m", dtype="float32")
N = 256
prompts = [llm.encode_prompt("Explain how a rainbow forms.", chat=True)]
b = engine.make_buckets(1, len(prompts[0]), N)
toks, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
sampling = llm.sampling_arrays([SamplingParams(max_new_tokens=N, ignore_eos=True)], b.batch, b.num_stop)
steps = []
for r in range(4):
    state = engine.prefill(llm.params, llm.config, b, toks, lens, active, sampling)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state = engine.decode_loop(llm.params, llm.config, state, sampling, jnp.int32(2 ** 30))
    jax.block_until_ready(state)
    if r:
        steps.append(1000 * (time.perf_counter() - t) / (N - 1))
print(f"specjax decode step: {np.median(steps):.2f} ms (loops: {', '.join(f'{s:.2f}' for s in steps)})")
