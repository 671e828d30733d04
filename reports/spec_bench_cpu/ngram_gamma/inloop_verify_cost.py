# Evidence (reports/README.md): ran at commit a1c5907, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=a1c5907 p=reports/spec_bench_cpu/ngram_gamma/inloop_verify_cost.py
"""In-loop verify cost: spec_loop with a drafter that always proposes gamma tokens (every step verifies) against the
plain decode loop and host-called verify_accept_jit, same prompt, alternating rounds."""
import dataclasses, sys, time, jax, jax.numpy as jnp, numpy as np
from specjax.api import LLM, pad_prompts
from specjax import engine, spec_engine
from specjax.config import SamplingParams
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.base import Proposal

@dataclasses.dataclass(frozen=True)
class Always(NgramDrafter):
    def propose(self, dparams, dstate, ctx):
        B = ctx.last_token.shape[0]; g = self.num_speculative_tokens
        toks = jnp.concatenate([ctx.last_token[:, None], jnp.full((B, g), 17, jnp.int32)], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, g + 1))
        return Proposal(toks, parents, jnp.ones((B, g + 1), bool), None), dstate

llm = LLM("smollm2-135m", dtype="float32")
g = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dr = Always(g, 3, 3)
N = 128
prompts = [llm.encode_prompt("Explain how a rainbow forms.", chat=True)]
b = engine.make_buckets(1, len(prompts[0]), N, extra_slots=dr.tree.num_nodes)
toks, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
sampling = llm.sampling_arrays([SamplingParams(max_new_tokens=N, ignore_eos=True)], b.batch, b.num_stop)
def spec():
    st = spec_engine.spec_prefill(llm.params, llm.config, {}, dr, b, toks, lens, active, sampling); jax.block_until_ready(st)
    t = time.perf_counter()
    st = spec_engine.spec_loop(llm.params, llm.config, {}, dr, st, sampling, jnp.int32(2 ** 30)); jax.block_until_ready(st)
    dt = time.perf_counter() - t
    return 1000 * dt / int(st.counts[0, 0]), int(st.counts[0, 1]), int(st.counts[0, 0])
def plain():
    st = engine.prefill(llm.params, llm.config, b, toks, lens, active, sampling); jax.block_until_ready(st)
    t = time.perf_counter()
    st = engine.decode_loop(llm.params, llm.config, st, sampling, jnp.int32(2 ** 30)); jax.block_until_ready(st)
    return 1000 * (time.perf_counter() - t) / (N - 1)
def host():
    st = spec_engine.spec_prefill(llm.params, llm.config, {}, dr, b, toks, lens, active, sampling); jax.block_until_ready(st)
    t = time.perf_counter(); n = 0
    while n < N - 1:
        prop, _ = spec_engine.propose_jit({}, dr, st, sampling)
        st = spec_engine.verify_accept_jit(llm.params, llm.config, dr.tree, dr.mode, st, prop, sampling); n += 1
    jax.block_until_ready(st)
    return 1000 * (time.perf_counter() - t) / n
spec(); plain(); host()
for r in range(3):
    s, v, c = spec(); p = plain(); h = host()
    print(f"plain {p:.2f} ms/step | spec_loop {s:.2f} ms/step ({v}/{c} verify) = {s/p:.2f}x | host verify {h:.2f} = {h/p:.2f}x", flush=True)
