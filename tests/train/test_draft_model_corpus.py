"""Draft-model training on a token-shard corpus (`python -m specjax.train.draft_model --corpus DIR`): the soft
targets the target computes on device line up with the text, the draft vocabulary comes from the training split,
training lowers the held-out loss and exports a loadable draft, --init-draft continues from a draft and keeps its
d2t, and a corpus of another tokenizer or one that changed under a run is refused."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax.models.draft_io import DraftError, load_draft
from specjax.train import draft_model as D
from specjax.train import generate as G
from specjax.train.corpus import count_tokens, tokenizer_always_ids, vocab_from_counts
from specjax.train.shards import ShardError, open_corpus

# Tied like SmolLM2: a draft's head is the embedding rows of its vocabulary, so a draft holding every target layer
# and the whole vocabulary is the target itself.
CFG = tiny_config(num_layers=4, vocab_size=259, architecture="LlamaForCausalLM", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-corpus")
    model = save_hf_model(d / "model", CFG, tiny_params(CFG, seed=5))
    G.main(["--out", str(d / "data"), "--target", model, "--candidates", "120", "--instruction-tokens", "20",
            "--max-new", "32", "--prompt-len", "96", "--batch", "16", "--steps", "4", "--block", "32",
            "--no-progress"])
    return model, str(d / "data" / "responses")


def _args(model, root, out, *extra):
    return ["--corpus", root, "--out", str(out), "--target", model, "--steps", "6", "--batch", "8", "--bucket", "16",
            "--draft-vocab", "128", "--init-layers", "0,3", "--lr", "1e-3", "--warmup", "1", "--eval-every", "100",
            "--checkpoint-every", "3", "--eval-batch", "8", "--eval-batches", "2", "--no-progress", *extra]


def _evals(out):
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    model, root = corpus
    out = tmp_path_factory.mktemp("draft-run") / "run"
    return out, D.main(_args(model, root, out))


def _target_params(model):
    from specjax.models.loading import load_model

    return load_model(model, "float32", with_tokenizer=False).params


def test_a_draft_that_is_the_target_agrees_with_every_greedy_token(corpus, tmp_path):
    """Every target layer and the whole vocabulary make the draft the target: at step 0 its argmax is the
    target's greedy token at (nearly: the generator's cached decode rounds differently on near-ties) every
    held-out greedy position, so positions, targets and masks line up, and chained drafts are accepted."""
    model, root = corpus
    D.main(_args(model, root, tmp_path / "run", "--steps", "1", "--init-layers", "0,1,2,3", "--draft-vocab", "259"))
    ev = _evals(tmp_path / "run")[0]
    assert ev["step"] == 0 and ev["positions"] > 50
    assert ev["greedy_in_draft_vocab"] == 1.0
    assert ev["agree"] > 0.98, ev["agree"]
    assert min(a for a in ev["alpha"][:4] if a is not None) > 0.95, ev["alpha"]


def test_training_on_the_corpus_lowers_the_heldout_loss_and_exports_a_loadable_draft(corpus, trained):
    model, root = corpus
    out, summary = trained
    evals = _evals(out)
    assert [e["step"] for e in evals] == [0, 6]
    # Six steps from target layers 0 and 3 (measured: loss 4.27 -> 4.04, agreement 0.21 -> 0.30; the 4-layer
    # target itself scores about 3.6 on its full vocabulary).
    first, last = evals[0], evals[-1]
    assert last["loss"] < first["loss"] - 0.1 and last["agree"] > first["agree"] + 0.04, (first, last)
    assert summary["heldout"]["positions"] == evals[0]["positions"] > 0
    assert summary["train_tokens_per_s_this_run"] > 0 and summary["draft_vocab"] == 128
    tparams = _target_params(model)
    cfg, params, d2t = load_draft(str(out / "draft"), tparams)
    assert cfg.num_layers == 2 and params["lm_head"].shape == (CFG.hidden_size, 128)
    # The draft vocabulary: the training split's most frequent response tokens (specials and stops kept).
    from specjax.models.loading import load_model

    always = tokenizer_always_ids(load_model(model).tokenizer)
    counts = count_tokens(open_corpus(root), CFG.vocab_size, "train")
    np.testing.assert_array_equal(np.asarray(d2t), vocab_from_counts(counts, 128, always))
    # The shipped (bf16) weights score like the trained ones.
    assert abs(summary["heldout_exported"]["loss"] - summary["heldout"]["loss"]) < 0.02
    assert os.path.isfile(out / "draft" / "training_curve.png")


def test_init_draft_starts_from_that_draft_and_keeps_its_vocabulary(corpus, trained, tmp_path):
    model, root = corpus
    out, first = trained
    tparams = _target_params(model)
    _, want, d2t = load_draft(str(out / "draft"), tparams)
    cfg, params, got_d2t = D.warm_start(str(out / "draft"), tparams)
    np.testing.assert_array_equal(got_d2t, np.asarray(d2t))
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wq"]), np.asarray(want["layers"][1]["wq"]))
    second = D.main(_args(model, root, tmp_path / "b", "--steps", "1", "--draft-vocab", "64", "--init-layers", "0",
                          "--init-draft", str(out / "draft")))
    assert second["draft_vocab"] == 128
    # Step 0 of the new run evaluates the first run's shipped weights on the same held-out batches.
    assert _evals(tmp_path / "b")[0]["loss"] == pytest.approx(first["heldout_exported"]["loss"], rel=1e-5)
    cfg2, _, d2t2 = load_draft(str(tmp_path / "b" / "draft"), tparams)
    assert cfg2.num_layers == cfg.num_layers == 2
    np.testing.assert_array_equal(np.asarray(d2t2), np.asarray(d2t))

    wide = tiny_config(num_layers=2, vocab_size=259, hidden_size=96, architecture="LlamaForCausalLM")
    D.save_draft(str(tmp_path / "wide"), D.draft_config(wide, 1), D.init_from_target(tiny_params(wide), (0,)),
                 np.arange(16), {"target": "wide"})
    with pytest.raises(DraftError, match=r"wide.*draft expects a target with vocab 259 and hidden 96"):
        D.main(_args(model, root, tmp_path / "c", "--init-draft", str(tmp_path / "wide")))


def test_a_corpus_of_another_tokenizer_is_refused(corpus, tmp_path):
    model, root = corpus
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(root):
        if name.endswith(".npz"):
            os.symlink(os.path.join(root, name), bad / name)
    man = json.load(open(os.path.join(root, "manifest.json")))
    json.dump(dict(man, tokenizer="0" * 64), open(bad / "manifest.json", "w"))
    with pytest.raises(ShardError, match="manifest.json: made with another tokenizer"):
        D.main(_args(model, str(bad), tmp_path / "run"))


def test_a_corpus_that_changed_under_a_run_is_refused_on_resume(corpus, tmp_path):
    model, root = corpus
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    D.main(_args(model, str(copy), tmp_path / "run", "--steps", "1"))
    man = json.load(open(copy / "manifest.json"))
    assert len(man["shards"]) > 1
    man["shards"] = man["shards"][:-1]
    json.dump(man, open(copy / "manifest.json", "w"))
    with pytest.raises(DraftError, match="other settings .*corpus_shards"):
        D.main(_args(model, str(copy), tmp_path / "run", "--steps", "1"))


def test_data_sources_are_exclusive_and_max_len_belongs_to_the_corpus(capsys):
    with pytest.raises(SystemExit):
        D.parse_args(["--data", "x.npz", "--corpus", "c", "--out", "o"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        D.parse_args(["--data", "x.npz", "--out", "o", "--max-len", "64"])
    assert "--max-len cuts the sequences of a --corpus" in capsys.readouterr().err
    args = D.parse_args(["--corpus", "a", "b", "--out", "o", "--max-len", "64"])
    assert args.corpus == ["a", "b"] and args.data is None and args.init_draft is None


def test_the_corpus_yaml_parses_into_the_trainer():
    from specjax.cli.main import main
    from specjax.config import load_yaml_dict, packaged_config_path
    from specjax.train.launch import main as launch, to_argv

    module, argv = to_argv(load_yaml_dict(packaged_config_path("train/draft_corpus"))["train"])
    args = D.parse_args(argv)
    assert module == "specjax.train.draft_model" and args.corpus and args.data is None and args.max_len > 0
    assert launch("train/draft_corpus", ["steps=3"], dry_run=True).startswith(
        "python -m specjax.train.draft_model --corpus ")
    assert main(["train-head", "--config", "train/draft_corpus", "--dry-run"]) == 0
