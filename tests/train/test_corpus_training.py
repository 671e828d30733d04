"""Head training on token shards: the streaming loader, recorded and online features, the loss kinds, data
parallelism over 8 simulated devices, and a SIGKILLed run that resumes to the uninterrupted result."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax.train import eagle as E
from specjax.train import generate as G
from specjax.train.corpus import CorpusBatches, coverage, count_tokens, device_targets, t2o_table
from specjax.train.shards import ShardError, open_corpus

CFG = tiny_config(num_layers=4, vocab_size=259, architecture="LlamaForCausalLM")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus-train")
    model = save_hf_model(d / "model", CFG, tiny_params(CFG, seed=9))
    G.main(["--out", str(d / "data"), "--target", model, "--candidates", "120", "--instruction-tokens", "20",
            "--max-new", "32", "--prompt-len", "96", "--batch", "16", "--steps", "4", "--block", "32",
            "--features", "--no-progress"])
    return model, str(d / "data" / "responses")


def _train_args(model, corpus, out, *extra):
    return ["--kind", "eagle3", "--corpus", corpus, "--out", str(out), "--target", model, "--steps", "4",
            "--batch", "8", "--bucket", "16", "--draft-vocab", "128", "--eval-every", "100", "--checkpoint-every", "2",
            "--eval-batches", "2", "--unroll", "5", "--no-progress", *extra]


def _train_losses(out):
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return np.asarray([r["loss"] for r in recs if r["kind"] == "train"])


def test_loader_is_deterministic_and_replays_after_a_jump(corpus):
    _, root = corpus
    cs = open_corpus(root)
    a = CorpusBatches(cs, batch=4, bucket=16, max_len=64, seed=1, features=True)
    first = [a.batch_at(k) for k in range(6)]
    b = CorpusBatches(cs, batch=4, bucket=16, max_len=64, seed=1, features=True)
    assert all(np.array_equal(b.batch_at(k)["tokens"], first[k]["tokens"]) for k in (3, 4, 1, 5))
    for bt in first:
        assert bt["tokens"].shape[1] % 16 == 0 and bt["tokens"].shape[1] <= 64
        assert bt["feats"].shape[:2] == bt["tokens"].shape
        for i, n in enumerate(bt["length"]):
            assert not bt["tokens"][i, n:].any()
    c = CorpusBatches(cs, batch=4, bucket=16, max_len=64, seed=2, features=False)
    assert not np.array_equal(c.batch_at(0)["tokens"], first[0]["tokens"]) and "feats" not in c.batch_at(1)


def test_recorded_features_give_the_online_targets(corpus):
    from specjax.models.loading import load_model
    from specjax.heads.eagle import default_eagle3_layers

    model, root = corpus
    m = load_model(model)
    layers = tuple(default_eagle3_layers(CFG.num_layers))
    hb = CorpusBatches(open_corpus(root), batch=8, bucket=16, max_len=64, seed=0, features=True).batch_at(0)
    out_ids = np.arange(0, CFG.vocab_size, 2, dtype=np.int32)  # the even ids as the head vocabulary
    table = t2o_table(CFG.vocab_size, out_ids)
    rec = device_targets(m.params, m.config, hb, out_ids, table, layers=layers, top_k=8, online=False)
    onl = device_targets(m.params, m.config, {k: v for k, v in hb.items() if k != "feats"}, out_ids, table,
                         layers=layers, top_k=8, online=True)
    mask = np.asarray(rec["mask"])
    assert mask.any() and np.array_equal(mask, np.asarray(onl["mask"]))
    np.testing.assert_allclose(np.asarray(rec["layers"])[mask], np.asarray(onl["layers"])[mask], atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(rec["greedy"]), np.asarray(onl["greedy"]))
    # Inside the head vocabulary the top-k mass sums to one; the indices are head-vocabulary indices.
    p = np.asarray(rec["soft_p"])[mask]
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    assert np.asarray(rec["soft_idx"]).max() < out_ids.size
    # On greedy answers the greedy target is the target's own argmax (the next token), -1 when outside the head
    # vocabulary: check it against the full LM head applied to the features.
    head = m.params["lm_head"] if "lm_head" in m.params else m.params["embed"].T
    full = np.asarray(rec["final"]) @ np.asarray(head)
    greedy_rows = np.asarray(hb["temperature"]) == 0
    sel = mask & greedy_rows[:, None]
    assert sel.any()
    want = np.asarray(table)[full.argmax(-1)]
    agree = np.mean(np.asarray(rec["greedy"])[sel] == want[sel])
    assert agree > 0.95, agree


def test_draft_vocabulary_coverage_grows_with_size(corpus):
    _, root = corpus
    cs = open_corpus(root)
    tr, ho = count_tokens(cs, CFG.vocab_size, "train"), count_tokens(cs, CFG.vocab_size, "heldout")
    cov = coverage(tr, ho if ho.sum() else tr, [16, 64, 259], always=[0, 1, 2])
    assert cov[16] <= cov[64] <= cov[259] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["tv", "hybrid"])
def test_online_and_recorded_training_agree_and_losses_run(corpus, tmp_path, loss):
    model, root = corpus
    s_rec = E.main(_train_args(model, root, tmp_path / "rec", "--loss", loss, "--features", "recorded"))
    s_onl = E.main(_train_args(model, root, tmp_path / "onl", "--loss", loss, "--features", "online"))
    assert s_rec["features"] == "recorded" and s_onl["features"] == "online"
    np.testing.assert_allclose(_train_losses(tmp_path / "rec"), _train_losses(tmp_path / "onl"), rtol=3e-2)
    assert s_rec["heldout"]["top1"] and len(s_rec["heldout"]["alpha"]) == 5
    assert len(s_rec["heldout"]["accept_t1"]) == 5 and all(0 <= a <= 1 for a in s_rec["heldout"]["accept_t1"])
    assert s_rec["train_tokens_per_s_this_run"] > 0


def test_training_refuses_another_tokenizers_corpus(corpus, tmp_path):
    model, root = corpus
    path = os.path.join(root, "manifest.json")
    man = json.load(open(path))
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(root):
        if name.endswith(".npz"):
            os.symlink(os.path.join(root, name), bad / name)
    json.dump(dict(man, tokenizer="0" * 64), open(bad / "manifest.json", "w"))
    with pytest.raises(ShardError, match="manifest.json: made with another tokenizer"):
        E.main(_train_args(model, str(bad), tmp_path / "run"))


def _subprocess_env(devices: int = 1) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


@pytest.mark.slow
def test_data_parallel_over_8_devices_equals_one_device(corpus, tmp_path):
    model, root = corpus
    for mesh in (1, 8):
        cmd = [sys.executable, "-m", "specjax.train.eagle", *_train_args(model, root, tmp_path / f"m{mesh}",
                                                                          "--mesh", str(mesh))]
        subprocess.run(cmd, check=True, env=_subprocess_env(8), capture_output=True, cwd=ROOT)
    np.testing.assert_allclose(_train_losses(tmp_path / "m1"), _train_losses(tmp_path / "m8"), rtol=1e-4)


@pytest.mark.slow
def test_sigkill_then_resume_ends_where_an_uninterrupted_run_ends(corpus, tmp_path):
    from safetensors.numpy import load_file

    model, root = corpus
    args = lambda out: [sys.executable, "-m", "specjax.train.eagle",
                        *_train_args(model, root, out, "--steps", "10", "--checkpoint-every", "3")]
    subprocess.run(args(tmp_path / "whole"), check=True, env=_subprocess_env(), capture_output=True, cwd=ROOT)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(args(cut), env=_subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT)
    deadline = time.time() + 300
    ckpt = cut / "checkpoints"
    while time.time() < deadline and proc.poll() is None:
        if ckpt.is_dir() and any(n.isdigit() and int(n) >= 3 for n in os.listdir(ckpt)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "head").exists()
    subprocess.run(args(cut), check=True, env=_subprocess_env(), capture_output=True, cwd=ROOT)
    a = load_file(str(tmp_path / "whole" / "head" / "model.safetensors"))
    b = load_file(str(cut / "head" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), rtol=0, atol=0, err_msg=k)
    np.testing.assert_allclose(_train_losses(tmp_path / "whole"), _train_losses(cut), rtol=1e-6)


@pytest.mark.slow
def test_a_corpus_that_changed_under_a_run_is_refused(corpus, tmp_path):
    import shutil

    model, root = corpus
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("features"))
    E.main(_train_args(model, str(copy), tmp_path / "run", "--steps", "1", "--features", "online"))
    man = json.load(open(copy / "manifest.json"))
    man["shards"] = man["shards"][:-1]
    json.dump(man, open(copy / "manifest.json", "w"))
    with pytest.raises(E.HeadTrainError, match="other settings .*corpus_shards"):
        E.main(_train_args(model, str(copy), tmp_path / "run", "--steps", "1", "--features", "online"))


@pytest.mark.slow
def test_eagle1_head_trains_on_the_corpus(corpus, tmp_path):
    model, root = corpus
    args = _train_args(model, root, tmp_path / "e1", "--steps", "2", "--loss-vocab", "64")
    args[args.index("eagle3")] = "eagle"
    s = E.main(args)
    assert s["kind"] == "eagle" and s["heldout"]["vocab"] == "full" and len(s["heldout"]["top1"]) == 5
    assert os.path.isfile(tmp_path / "e1" / "head" / "model.safetensors")


def test_warm_start_continues_from_a_head_and_keeps_its_draft_vocabulary(corpus, tmp_path):
    """--init-head: the run starts from that head's weights (not the target's layer) and keeps an EAGLE-3 head's
    draft vocabulary whatever --draft-vocab says; a head of another kind, other feature layers or another
    target width is refused with an error naming the head."""
    from specjax.heads.eagle_io import HeadMismatchError, load_head, save_head
    from specjax.heads.eagle import head_config, init_from_target
    from specjax.models.loading import load_model

    model, root = corpus
    first = E.main(_train_args(model, root, tmp_path / "a", "--steps", "2"))
    assert first["vocab"] == 128
    tcfg = load_model(model, "float32", with_tokenizer=False).config
    hcfg, hp = load_head(str(tmp_path / "a" / "head"), tcfg)
    args = E.parse_args(_train_args(model, root, tmp_path / "b", "--draft-vocab", "64", "--init-head",
                                    str(tmp_path / "a" / "head")))
    cfg, params = E.warm_start(args.init_head, "eagle3", tcfg, None)
    assert cfg == hcfg
    np.testing.assert_array_equal(np.asarray(params["fc"]), np.asarray(hp["fc"], np.float32))
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["wq"]), np.asarray(hp["layers"][0]["wq"], np.float32))
    second = E.main(_train_args(model, root, tmp_path / "b", "--steps", "1", "--draft-vocab", "64", "--init-head",
                                str(tmp_path / "a" / "head")))
    assert second["vocab"] == 128
    _, hp2 = load_head(str(tmp_path / "b" / "head"), tcfg)
    np.testing.assert_array_equal(hp2["draft_ids"], hp["draft_ids"])

    with pytest.raises(E.HeadTrainError, match=r"--init-head .*head: a 'eagle3' head cannot start a 'eagle' run"):
        E.warm_start(str(tmp_path / "a" / "head"), "eagle", tcfg, None)
    with pytest.raises(E.HeadTrainError, match=r"fuses target layers \[.*\], the run asks for \[0, 1, 2\]"):
        E.warm_start(str(tmp_path / "a" / "head"), "eagle3", tcfg, (0, 1, 2))
    wide = tiny_config(num_layers=4, vocab_size=259, hidden_size=96, architecture="LlamaForCausalLM")
    wcfg = head_config(wide, "eagle3", draft_vocab_size=32)
    wp = init_from_target(wcfg, tiny_params(wide, seed=1), draft_ids=np.arange(32))
    save_head(str(tmp_path / "wide"), wcfg, jax_to_np(wp))
    with pytest.raises(HeadMismatchError, match=r"wide: head hidden size 96 != target hidden size 64"):
        E.main(_train_args(model, root, tmp_path / "c", "--init-head", str(tmp_path / "wide")))


def jax_to_np(tree):
    import jax

    return jax.tree.map(np.asarray, tree)


def test_recorded_features_missing_for_some_shards_name_the_fix(corpus, tmp_path):
    """A committed corpus keeps its feature files on the machine that made them: --features recorded over shards
    without them is refused with the way out, and --corpus-blocks trains on the recorded blocks alone."""
    import shutil

    model, root = corpus
    part = tmp_path / "part"
    shutil.copytree(root, part)
    man = json.load(open(part / "manifest.json"))
    assert len(man["shards"]) >= 2
    first = man["shards"][0]
    os.remove(part / "features" / first["features"])
    with pytest.raises(E.HeadTrainError, match="--corpus-blocks"):
        E.main(_train_args(model, str(part), tmp_path / "run", "--features", "recorded"))
    s = E.main(_train_args(model, str(part), tmp_path / "run2", "--features", "recorded",
                           "--corpus-blocks", f"{first['block'] + 1}:"))
    assert s["features"] == "recorded"
    assert s["corpus"][str(part)]["shards"] == len(man["shards"]) - 1
    held = s["heldout"]
    assert len(held["accept_t1"]) == len(held["top1"]) and all(0 < a <= 1 for a in held["accept_t1"])


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions():
    from specjax.train.eagle import sampled_acceptance

    accept = np.array([[[0.7, 0.7, 0.0]], [[0.5, 0.5, 0.9]]])
    valid = np.array([[[True, True, False]], [[True, True, False]]])
    out = sampled_acceptance(accept, valid)
    np.testing.assert_allclose(out["accept_t1"], [0.7, 0.5])
    np.testing.assert_allclose(out["tau_chain_t1"], 1 + 0.7 + 0.7 * 0.5)
