"""Meshes (specjax.mesh), the mesh option of LLM / CLI / config, and multi-process batch jobs.

Fast tests run in this process (one CPU device; meshes of more devices are AbstractMeshes, which need no
devices). The tests on 8 simulated devices run tests/mesh_worker.py in a subprocess, because the device count is
fixed when jax is imported and the rest of the suite keeps one device; the multi-process tests run two
tests/mesh_dist_worker.py processes joined by jax.distributed over localhost.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from specjax import mesh as M
from specjax.config import ConfigError, load_run_config
from specjax.errors import SpecjaxError
from specjax.models.llama import fuse_projections
from specjax.runners import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from spec_helpers import tiny_config, tiny_params  # noqa: E402


def abstract(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), M.AXES)


# ------------------------------------------------------------------------------------------------ mesh config


@pytest.mark.parametrize("text, sizes", [("data=2,model=4", (2, 4)), ("model=4", (2, 4)), ("data=8", (8, 1)),
                                         ("auto", (8, 1)), (" model = 8 ", (1, 8)), ("data=0,model=2", (4, 2))])
def test_mesh_text_and_derived_sizes(text, sizes):
    assert M.MeshConfig.parse(text).sizes(8) == sizes


def test_mesh_from_dict_and_config_are_the_same_and_hashable():
    a = M.MeshConfig.from_user({"data": 2, "model": 4})
    assert a == M.MeshConfig.from_user("data=2,model=4") == M.MeshConfig.from_user(a)
    assert hash(a) == hash(M.MeshConfig(2, 4))
    assert M.MeshConfig.parse(a.text()) == a


@pytest.mark.parametrize("spec, needle", [
    ("data=2,modle=4", "did you mean 'model'"),
    ({"dta": 2}, "did you mean 'data'"),
    ("data=2;model=4", "not axis=size"),
    ("data=two", "whole number"),
    ("data=2,data=4", "given twice"),
    ("attention=shrad", "did you mean 'shard'"),
    (3, "not int"),
])
def test_bad_mesh_text_is_a_clear_config_error(spec, needle):
    with pytest.raises(M.MeshError, match=needle) as e:
        M.MeshConfig.from_user(spec)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError) and isinstance(e.value, SpecjaxError)


@pytest.mark.parametrize("spec, devices, needle", [
    ("model=3", 8, "model=3 does not divide the 8 devices"),
    ("data=3,model=1", 8, r"3 devices does not divide the 8 devices"),
    ("data=4,model=4", 8, "needs 16 devices, but 8 are available"),
    ("data=2,model=4", 1, "needs 8 devices, but 1 is available.*xla_force_host_platform_device_count"),
])
def test_mesh_that_does_not_fit_the_devices_names_the_counts(spec, devices, needle):
    with pytest.raises(M.MeshError, match=needle):
        M.MeshConfig.parse(spec).sizes(devices)


def test_one_device_mesh_is_allowed_and_named_data_model():
    mesh = M.make_mesh("data=1,model=1")
    assert mesh.axis_names == M.AXES and mesh.devices.size == 1
    with pytest.raises(M.MeshError, match="did you mean 'model'"):
        M.check_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "modl")))


# ------------------------------------------------------------------------------------------------ the plan


def test_plan_shards_what_divides_and_replicates_attention_otherwise():
    smol = tiny_config(49152, num_heads=9, num_kv_heads=3, hidden_size=576, intermediate_size=1536, head_dim=64)
    with pytest.warns(UserWarning, match="attention replicated over model=4: it does not divide the 3 KV heads"):
        plan = M.plan_for(smol, abstract(2, 4))
    assert plan.sharded == {"vocab", "mlp"}
    assert plan.spec(("vocab", "embed")) == jax.sharding.PartitionSpec("model", None)
    assert plan.spec(("embed", "heads")) == jax.sharding.PartitionSpec(None, None)
    assert plan.spec(("batch", None)) == jax.sharding.PartitionSpec("data", None)
    tiny = tiny_config(96)  # 4 heads, 2 KV heads
    assert M.plan_for(tiny, abstract(4, 2)).sharded == {"vocab", "mlp", "heads", "kv_heads"}
    assert M.plan_for(tiny, abstract(8, 1)).sharded == frozenset()


def test_plan_errors_name_the_sizes():
    with pytest.raises(M.MeshError, match=r"model=4 does not divide the vocabulary \(98 tokens\)"):
        M.plan_for(tiny_config(98), abstract(2, 4))
    with pytest.raises(M.MeshError, match="model=4 does not divide the 2 KV heads"):
        M.plan_for(tiny_config(96), abstract(2, 4), "shard")
    with pytest.raises(M.MeshError, match="unknown"):
        M.plan_for(tiny_config(96), AbstractMesh((2, 4), ("data", "tensor")))


def test_unfuse_inverts_fuse_exactly():
    cfg = tiny_config(96, attention_bias=True)
    params = tiny_params(cfg, seed=3)
    params["layers"] = [dict(lp, bq=lp["wq"][0], bk=lp["wk"][0], bv=lp["wv"][0]) for lp in params["layers"]]
    back = M.unfuse_projections(fuse_projections(params), cfg)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_one_device_mesh_places_and_generates_like_no_mesh():
    """The sharding code paths on a 1x1 mesh (placement, the mesh context, the XLA paths instead of the CPU
    kernels) give the plain greedy tokens of the unplaced model."""
    from spec_helpers import make_sampling, outputs, run_plain, tiny_buckets
    from specjax import engine
    from specjax.requests import pad_prompts

    cfg = tiny_config(96)
    params = fuse_projections(tiny_params(cfg, seed=1))
    plan = M.plan_for(cfg, M.make_mesh("data=1,model=1"))
    placed = M.place_params(params, cfg, plan)
    assert all(isinstance(a.sharding, jax.sharding.NamedSharding) for a in jax.tree_util.tree_leaves(placed))
    b, s = tiny_buckets(2, max_new=12), make_sampling(2, max_new=12)
    prompts = [[3, 9, 27, 81], [7, 7, 8]]
    ref, _ = outputs(run_plain(params, cfg, b, prompts, s))
    with plan.context():
        got, _ = outputs(run_plain(placed, cfg, b, prompts, s))
        tokens, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
        state = M.place_state(engine.prefill(placed, cfg, b, tokens, lens, active, s), plan)
        assert isinstance(state.cache.k[0].sharding, jax.sharding.NamedSharding)
        again, _ = outputs(engine.decode_loop(placed, cfg, state, s, jax.numpy.int32(2 ** 30)))
    assert got == ref == again
    assert M.describe(plan, placed)["bytes_per_device"] == sum(a.nbytes for a in jax.tree_util.tree_leaves(placed))


# ------------------------------------------------------------------------------------------------ API, CLI, config


def test_config_and_cli_carry_the_mesh():
    import argparse

    from specjax.cli.common import add_config_flags, shortcut_overrides

    p = argparse.ArgumentParser()
    add_config_flags(p)
    cfg = load_run_config(None, shortcut_overrides(p.parse_args(["--mesh", "data=2,model=4"])))
    assert cfg.backend.mesh == "data=2,model=4"
    assert load_run_config(None, []).backend.mesh is None
    with pytest.raises(ConfigError, match="mesh"):
        load_run_config(None, ["backend.mseh=data=2"])


def test_llm_rejects_a_bad_mesh_before_loading():
    from specjax.api import LLM

    with pytest.raises(M.MeshError, match="did you mean 'model'"):
        LLM("no-such-model", mesh="data=1,modle=1")
    with pytest.raises(M.MeshError, match="needs 2 devices, but 1 is available"):
        LLM("no-such-model", mesh="data=2")
    with pytest.raises(ConfigError, match="Neuron policy runs on one device"):
        LLM("no-such-model", mesh="data=1", backend="neuron")


# ------------------------------------------------------------------------------------------------ HLO parsing


def test_collectives_and_vocab_gathers_are_read_from_hlo_text():
    text = "\n".join([
        '  %all-gather.4 = f32[2,768]{0,1} all-gather(%x), channel_id=18, dimensions={1}',
        '  %all-gather = s32[2,4]{0,1} all-gather(%y), channel_id=1, dimensions={1}',
        '  %all-reduce.1 = f32[2]{0} all-reduce(%z), channel_id=4, to_apply=%add',
        '  %add.3 = f32[2,768]{1,0} add(%a, %b)',
    ])
    assert M.collectives(text) == [("all-gather", "f32[2,768]{0,1}"), ("all-gather", "s32[2,4]{0,1}"),
                                   ("all-reduce", "f32[2]{0}")]
    assert M.gathers_of_axis(text, 768) == ["f32[2,768]{0,1}"]
    assert M.gathers_of_axis(text, 1000) == []


# ------------------------------------------------------------------------------------------------ shards and merge


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_merge_orders_by_input_and_checks_the_shards(tmp_path):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    _write(inp, [{"id": i, "prompt": "x"} for i in range(5)])
    _write(distributed.shard_path(out, 0), [{"id": 4, "text": "d"}, {"id": 0, "text": "a"}, {"id": 2, "text": "c"}])
    _write(distributed.shard_path(out, 1), [{"id": 3, "text": "c"}, {"id": 1, "text": "b"}])
    assert distributed.merge_shards(inp, out, 2) == 5
    with open(out) as f:
        assert [json.loads(x)["id"] for x in f] == [0, 1, 2, 3, 4]
    with pytest.raises(distributed.DistributedError, match=r"part-2.*missing: rerun process 2 of 3"):
        distributed.merge_shards(inp, out, 3)
    _write(distributed.shard_path(out, 1), [{"id": 0, "text": "a"}])
    with pytest.raises(distributed.DistributedError, match="id 0 is in two shards"):
        distributed.merge_shards(inp, out, 2)
    _write(distributed.shard_path(out, 1), [{"id": "zz", "text": "a"}])
    with pytest.raises(distributed.DistributedError, match="not in"):
        distributed.merge_shards(inp, out, 2)


@pytest.mark.parametrize("n, pid, coord, needle", [(0, 0, None, "must be >= 1"), (2, 2, "h:1", "outside 0..1"),
                                                   (2, 0, "", "--coordinator")])
def test_bad_process_layout_is_a_clear_error(n, pid, coord, needle):
    with pytest.raises(distributed.DistributedError, match=needle):
        distributed.check_processes(n, pid, coord)


# ------------------------------------------------------------------------------------------------ 8 simulated devices


def _worker(*args: str, timeout: int = 3000) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mesh_worker.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tiny_model_on_meshes_matches_one_device():
    """Plain and draft-model greedy decoding of a tiny model on (1,8), (2,4), (8,1) and (4,2) -- the last one
    splits attention heads -- equal one device, and the KV cache is split as the plan says."""
    res = _worker("tiny", "--meshes", "1x8,2x4,8x1,4x2")
    for label in ("1x8", "2x4", "8x1", "4x2"):
        assert res[label]["plain"] == res["single"]["plain"], label
        assert res[label]["draft"] == res["single"]["draft"] == res["single"]["plain"], label
        assert res[label]["verify_steps"] > 0
    assert "heads" in res["4x2"]["sharded"] and res["4x2"]["cache_spec"][:2] == ["data", "model"]
    assert res["2x4"]["cache_spec"][:2] in (["data"], ["data", None]) and res["2x4"]["sharded"] == ["mlp", "vocab"]


@pytest.mark.slow
def test_greedy_paths_reduce_max_index_pairs_not_full_logits():
    """Compiled HLO on vocab-split meshes: the greedy step gathers only (max, index) pairs, one per vocabulary
    shard, and all-reduces the row-parallel products; every all-gather of a full vocabulary row in the decode and
    speculative loops is an inverse-CDF sampler's cumulative sum, never the greedy argmax."""
    res = _worker("hlo", "--meshes", "2x4,1x8")
    for label, model in (("2x4", 4), ("1x8", 8)):
        step = res[label]["greedy_step"]
        assert step["vocab_gathers"] == []
        shapes = [shape for op, shape in step["collectives"] if op == "all-gather"]
        assert any(s.startswith(f"s32[4,{model}]") or s.startswith(f"s32[{4 // (8 // model)},{model}]")
                   for s in shapes), shapes
        assert any(op == "all-reduce" for op, _ in step["collectives"])
        # Plain decoding: the loop's only full-vocabulary gather is the sampler's, in the sampled branch
        # (branch 1 of the cond on temperature; branch 0, the greedy argmax, has none).
        names = res[label]["decode_loop"]["vocab_gathers"]
        assert names and all(n.startswith("jit(decode_loop)/while/body/cond/branch_1_fun/") for n in names), names
        # Speculation: every full-vocabulary gather is an inverse-CDF sampler's cumulative sum (the rejection
        # rule's, and the draft model's own proposals); no argmax, no LM head, no logits gather.
        names = res[label]["spec_loop"]["vocab_gathers"]
        assert all(n.endswith("jit(cumsum)/reduce_window_sum") for n in names), names


@pytest.mark.slow
def test_real_model_greedy_on_meshes_equals_one_device():
    """SmolLM2-135M (9 heads, 3 KV heads, vocabulary 49152) on (1,8), (2,4), (8,1): plain decoding and n-gram,
    draft-model and EAGLE-3 speculation give the single-device greedy tokens, with speculation really verifying."""
    # SPECJAX_MESH_METHODS narrows the methods (CI runs a subset within its time limit); the default is all four.
    methods = os.environ.get("SPECJAX_MESH_METHODS", "plain,ngram,draft_model,eagle3").split(",")
    res = _worker("real", "--meshes", "1x8,2x4,8x1", "--methods", ",".join(methods))
    single = res["single"]
    for method in methods[1:]:
        assert single[method] == single["plain"], method
        assert single[method + ":verify_steps"] > 0, method
    for label in ("1x8", "2x4", "8x1"):
        for method in methods:
            assert res[label][method] == single[method], (label, method)


@pytest.mark.slow
def test_server_on_a_mesh_serves_the_single_device_text():
    """`specjax serve` with a mesh (the real model on (2,4): batch over `data`, heads / MLP / vocabulary over
    `model`): greedy completions through the `openai` client, plain and n-gram, equal `LLM.generate` on one
    device."""
    res = _worker("serve", "--meshes", "2x4", "--methods", "plain,ngram", "--max-tokens", "24")
    single = res["single"]
    assert single["ngram"] == single["plain"] and all(single["plain"])
    for method in ("plain", "ngram"):
        assert res["2x4"][method] == single[method], method
    # the engine thread traced the model's programs under the mesh, never outside it
    assert res["2x4"]["traced"]["on_mesh"] > 0 and res["2x4"]["traced"]["off_mesh"] == 0, res["2x4"]["traced"]


# ------------------------------------------------------------------------------------------------ two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_pair(inp, out, pace: float = 0.0) -> list[subprocess.Popen]:
    """Both processes of a job; each one's stderr goes to OUT.err-<id> (files, not pipes: a process must never
    block on a full pipe nobody reads while the test waits for the other)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    coord = f"localhost:{_free_port()}"
    procs = []
    for pid in range(2):
        with open(f"{out}.err-{pid}", "w") as err:
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "mesh_dist_worker.py"), coord, "2",
                                           str(pid), str(inp), str(out), str(pace)], env=env, stderr=err))
        procs[-1].err_path = f"{out}.err-{pid}"
    return procs


def _wait(procs, timeout=1800):
    for p in procs:
        p.wait(timeout=timeout)
        with open(p.err_path) as f:
            assert p.returncode == 0, f.read()[-3000:]


@pytest.mark.slow
def test_two_processes_share_a_batch_job_and_resume_after_a_kill(tmp_path):
    """Two processes joined by jax.distributed (gloo over localhost) serve one job: the merged output has
    exactly the tokens one process gives, each shard holds its half. Then a fresh job: process 1 is killed
    after its first result, both are rerun, and the merged output is again the single-process one."""
    sys.path.insert(0, os.path.join(HERE, "runners"))
    import test_batch

    inp = test_batch.write_jsonl(tmp_path / "in.jsonl", test_batch.make_requests(8))
    summary, _ = test_batch.job(test_batch.tiny_llm(), inp, tmp_path / "single.jsonl")
    single = test_batch.by_id(test_batch.read_results(tmp_path / "single.jsonl"))
    assert summary.completed == 8

    out = tmp_path / "out.jsonl"
    _wait(_start_pair(inp, out))
    merged = test_batch.read_results(out)
    assert [r["id"] for r in merged] == [r["id"] for r in test_batch.make_requests(8)]
    for k, r in test_batch.by_id(merged).items():
        assert r["token_ids"] == single[k]["token_ids"], k
    parts = [test_batch.read_results(distributed.shard_path(str(out), p)) for p in range(2)]
    assert [len(p) for p in parts] == [4, 4]

    out2 = tmp_path / "out2.jsonl"
    procs = _start_pair(inp, out2, pace=1.0)
    part1 = distributed.shard_path(str(out2), 1)
    deadline = time.monotonic() + 1500
    while time.monotonic() < deadline and procs[1].poll() is None:
        if os.path.exists(part1) and open(part1, "rb").read().count(b"\n") >= 1:
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    procs[0].kill()  # its barrier would wait for the dead peer
    procs[0].wait()
    done_before = open(part1, "rb").read().count(b"\n")
    assert 1 <= done_before < 4 and not out2.exists()
    _wait(_start_pair(inp, out2))
    got = test_batch.by_id(test_batch.read_results(out2))
    assert set(got) == set(single)
    for k, r in single.items():
        assert got[k]["token_ids"] == r["token_ids"], k
