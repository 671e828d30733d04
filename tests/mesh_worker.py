"""Runs in a subprocess with simulated CPU devices (tests/test_mesh.py starts it): the rest of the test suite
keeps its one device, and XLA_FLAGS must be set before jax is imported.

    python tests/mesh_worker.py real  --devices 8 --meshes 1x8,2x4,8x1 --methods plain,ngram,draft_model,eagle3
    python tests/mesh_worker.py tiny  --devices 8 --meshes 1x8,2x4,8x1,4x2
    python tests/mesh_worker.py hlo   --devices 8 --meshes 2x4,1x8
    python tests/mesh_worker.py serve --devices 8 --meshes 2x4 --methods plain,ngram

Prints one JSON object on its last line: tokens per (mesh, method), or the collectives found in compiled HLO.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _setup(devices: int) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _meshes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in m.split("x")) for m in text.split(",") if m]


PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences."]
METHOD_CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
              "adaptive": False},
    "draft_model": {"method": "draft_model", "model": "assets/smollm2-135m-draft", "num_speculative_tokens": 4,
                    "adaptive": False},
    "eagle3": {"method": "eagle3", "model": "assets/smollm2-135m-eagle3", "num_speculative_tokens": 4, "top_k": 1,
               "depth": 4, "total_tokens": 4, "adaptive": False},
}


def real(meshes, methods, max_tokens: int) -> dict:
    """Greedy tokens of every method, on one device and on each mesh: {"single": {method: [[ids]]}, "2x4": ...}
    plus verify-step counts (speculation must really have run)."""
    from specjax.api import LLM
    from specjax.config import SamplingParams

    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for label, mesh in [("single", None)] + [(f"{d}x{m}", f"data={d},model={m}") for d, m in meshes]:
        llm = LLM(mesh=mesh) if mesh else LLM()
        res = {}
        for method in methods:
            outs = llm.generate(PROMPTS, sp, speculative_config=METHOD_CONFIGS[method] or {"method": None},
                                chat=True)
            res[method] = [o.outputs[0].token_ids for o in outs]
            res[method + ":verify_steps"] = sum(int(getattr(o.metrics, "verify_steps", 0) or 0) for o in outs)
        out[label] = res
        del llm
    return out


def tiny(meshes) -> dict:
    """Plain and draft-model greedy tokens of a tiny model (4 heads, 2 KV heads: model=2 splits attention,
    model=4 and 8 replicate it) on one device and on each mesh."""
    import jax
    from spec_helpers import (make_sampling, outputs, run_plain, run_spec, tiny_buckets, tiny_config, tiny_params)
    from specjax import mesh as M
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.models.llama import fuse_projections

    V = 96
    cfg, dcfg = tiny_config(V), tiny_config(V, num_layers=1)
    params = fuse_projections(tiny_params(cfg, seed=1))
    dparams = {"params": fuse_projections(tiny_params(dcfg, seed=2))}
    drafter = DraftModelDrafter(dcfg, 3, V)
    prompts = [[3, 9, 27, 81, 50, 11], [7, 7, 8], [1, 2, 3, 4], [5, 6]]
    b, s = tiny_buckets(4, max_new=20), make_sampling(4, max_new=20)
    out = {"single": {"plain": outputs(run_plain(params, cfg, b, prompts, s))[0],
                      "draft": outputs(run_spec(params, cfg, dparams, drafter, b, prompts, s).dec)[0]}}
    for d, m in meshes:
        plan = M.plan_for(cfg, M.make_mesh({"data": d, "model": m}), warn=False)
        p, dp = M.place_params(params, cfg, plan), M.replicate(dparams, plan)
        with plan.context():
            st = run_spec(p, cfg, dp, drafter, b, prompts, s)
            out[f"{d}x{m}"] = {"plain": outputs(run_plain(p, cfg, b, prompts, s))[0],
                               "draft": outputs(st.dec)[0], "sharded": sorted(plan.sharded),
                               "verify_steps": int(jax.device_get(st.stats.verify_steps).sum()),
                               "cache_spec": list(st.dec.cache.k[0].sharding.spec)}
    return out


def serve(meshes, methods, max_tokens: int) -> dict:
    """The real model served on each mesh (`build_server`, uvicorn on 127.0.0.1, the `openai` client): greedy
    completion texts per method, and `LLM.generate`'s texts on one device: {"single": {method: [text]}, "2x4": ...}.
    """
    import openai
    from serve_helpers import RunningServer
    from specjax.api import LLM
    from specjax.config import SamplingParams
    from specjax.runners.serving import EngineOptions
    from specjax.serve import build_server

    # completion prompts (no chat template) that the model continues rather than ends at once
    prompts = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    single = LLM()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    out = {"single": {m: [o.text for o in single.generate(prompts, sp, speculative_config=METHOD_CONFIGS[m]
                                                          or {"method": None})] for m in methods}}
    del single
    # Which traces of the engine thread ran under the mesh (the model's programs must all do).
    import threading
    from specjax.models import llama

    traced = {"on_mesh": 0, "off_mesh": 0}
    real_under_mesh = llama.under_mesh

    def spy() -> bool:
        on = real_under_mesh()
        if threading.current_thread().name == "specjax-engine":
            traced["on_mesh" if on else "off_mesh"] += 1
        return on

    llama.under_mesh = spy
    options = EngineOptions(max_batch=2, max_prompt_tokens=64, max_tokens=max_tokens, max_queue=8, step_chunk=4)
    for d, m in meshes:
        llm = LLM(mesh=f"data={d},model={m}")
        res = {}
        for method in methods:
            app, engine = build_server(llm, METHOD_CONFIGS[method], options, model_name="smollm2")
            server = RunningServer(app, engine)
            try:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
                res[method] = [client.completions.create(model="smollm2", prompt=p, max_tokens=max_tokens,
                                                         temperature=0).choices[0].text for p in prompts]
            finally:
                server.stop()
                engine.shutdown()
        out[f"{d}x{m}"] = dict(res, traced=dict(traced))
        del llm
    return out


def hlo(meshes) -> dict:
    """Collectives of the compiled plain decode loop, of a greedy step alone, and of the speculative loop (draft
    model), for a tiny model with a vocabulary of 768 on each mesh; the op_name of every full-vocabulary
    all-gather."""
    import re

    import jax
    import jax.numpy as jnp
    from spec_helpers import make_sampling, spec_start, tiny_buckets, tiny_config, tiny_params
    from specjax import engine, mesh as M, spec_engine
    from specjax.requests import pad_prompts
    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.models.llama import forward, fuse_projections
    from specjax.sampling import greedy_tokens

    V = 768
    cfg = tiny_config(V, num_heads=8, num_kv_heads=4)
    dcfg = tiny_config(V, num_layers=1)
    params = fuse_projections(tiny_params(cfg, seed=1))
    dparams = {"params": fuse_projections(tiny_params(dcfg, seed=2))}
    drafter = DraftModelDrafter(dcfg, 3, V)
    prompts = [[3, 9, 27, 81, 50, 11], [7, 7, 8], [1, 2, 3, 4], [5, 6]]
    b, s = tiny_buckets(4, max_new=20), make_sampling(4, max_new=20)

    def greedy_step(params, state, sampling):
        c = state.cache
        out = forward(params, cfg, state.last_token[:, None], c.lengths[:, None], c)
        return greedy_tokens(out.logits[:, 0], sampling)

    def names(text):
        """The op_name of each consumer of every full-vocabulary all-gather: what the gathered row is for. (XLA
        names the gather itself after its producer or its consumer depending on the version: jax 0.10 after
        the cumulative sum reading it, 0.11 after the elementwise maximum feeding it.)"""
        lines = text.splitlines()
        res = []
        for line in lines:
            if " all-gather(" in line or " all-gather-start(" in line:
                shape = line.split("=", 1)[1].split("all-gather", 1)[0].strip()
                dims = [int(x) for x in re.findall(r"\d+", shape.split("[", 1)[1].split("]", 1)[0])]
                if V in dims:
                    name = line.split("=", 1)[0].split()[-1]
                    use = re.compile(re.escape(name) + r"[,)]")
                    for other in lines:
                        if use.search(other.split("=", 1)[-1]) and other.split("=", 1)[0].split()[-1:] != [name]:
                            op = re.search(r'op_name="([^"]*)"', other)
                            res.append(op.group(1) if op else "?")
        return res

    out = {}
    for d, m in meshes:
        plan = M.plan_for(cfg, M.make_mesh({"data": d, "model": m}), warn=False)
        p, dp = M.place_params(params, cfg, plan), M.replicate(dparams, plan)
        with plan.context():
            tokens, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
            st = engine.prefill(p, cfg, b, tokens, lens, active, s)
            texts = {
                "greedy_step": jax.jit(greedy_step).lower(p, st, s).compile().as_text(),
                "decode_loop": engine.decode_loop.lower(p, cfg, st, s, jnp.int32(4)).compile().as_text(),
            }
            sst = spec_start(p, cfg, dp, drafter, b, prompts, s)
            texts["spec_loop"] = spec_engine.spec_loop.lower(p, cfg, dp, drafter, sst, s,
                                                             jnp.int32(4)).compile().as_text()
        out[f"{d}x{m}"] = {k: {"collectives": M.collectives(t), "vocab_gathers": names(t)} for k, t in texts.items()}
        out[f"{d}x{m}"]["sharded"] = sorted(plan.sharded)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("real", "tiny", "hlo", "serve"))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--meshes", default="1x8,2x4,8x1")
    ap.add_argument("--methods", default="plain,ngram,draft_model,eagle3")
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    _setup(a.devices)
    meshes = _meshes(a.meshes)
    if a.mode == "real":
        res = real(meshes, a.methods.split(","), a.max_tokens)
    elif a.mode == "tiny":
        res = tiny(meshes)
    elif a.mode == "serve":
        res = serve(meshes, a.methods.split(","), a.max_tokens)
    else:
        res = hlo(meshes)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
