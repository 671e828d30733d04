"""Bad speculative configurations and requests fail early with one clear line (fast: nothing is compiled).

Each error is checked for its type (a ValueError subclass), for naming the problem, and for being one line; a
positive control next to it shows that the same setup without the mistake is accepted, so the error comes
from the mistake and not from the setup.
"""
from __future__ import annotations

import pytest

from specjax.drafters.build import SpeculativeConfigError, resolve_draft_path
from specjax.runners.speculative import drafter_for
from specjax.api import RequestError
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.drafters.ngram import NgramDrafter
from specjax.tree import TreeError, chain

from spec_helpers import save_hf_llama, tiny_config, tiny_llm, tiny_params

V = 40
CONTEXT = 64
PROMPT = list(range(1, 11))  # 10 tokens


@pytest.fixture(scope="module")
def llm():
    config = tiny_config(V)
    return tiny_llm(config, tiny_params(config, seed=0), max_context=CONTEXT)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and msg and "\n" not in msg, repr(msg)
    return msg


def gen(llm, spec, max_new: int = 4):
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=max_new), speculative_config=spec)


@pytest.mark.parametrize("gamma", [0, -3])
def test_gamma_below_one(llm, gamma):
    with pytest.raises(ConfigError) as e:
        gen(llm, {"method": "ngram", "num_speculative_tokens": gamma})
    msg = one_line(e)
    assert "num_speculative_tokens" in msg and ">= 1" in msg
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=gamma)
    with pytest.raises(TreeError):
        chain(gamma)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=1).num_speculative_tokens == 1


def test_gamma_beyond_the_context(llm):
    # 10 prompt tokens + 20 new tokens + 41 verify slots (gamma 40 + the root) = 71 > 64
    with pytest.raises(RequestError) as e:
        gen(llm, {"method": "ngram", "num_speculative_tokens": 40}, max_new=20)
    msg = one_line(e)
    assert "speculative" in msg and str(CONTEXT) in msg and "71" in msg, msg
    # the request alone fits: the speculative slots are what overflows
    llm.check_request(0, PROMPT, SamplingParams(max_new_tokens=20), 0)


def test_gamma_alone_beyond_the_context_names_gamma_as_the_fix(llm):
    # 10 prompt tokens + 61 verify slots > 64 whatever max_new_tokens is
    with pytest.raises(RequestError) as e:
        gen(llm, {"method": "ngram", "num_speculative_tokens": 60}, max_new=1)
    msg = one_line(e)
    assert "num_speculative_tokens" in msg and "to 0 or less" not in msg, msg


def test_draft_model_with_another_vocabulary(llm, tmp_path):
    other = tiny_config(V + 8, num_layers=1)
    bad = save_hf_llama(str(tmp_path / "draft_v48"), other, tiny_params(other, seed=1))
    with pytest.raises(SpeculativeConfigError) as e:
        gen(llm, {"method": "draft_model", "model": bad, "num_speculative_tokens": 3})
    msg = one_line(e)
    assert "vocabulary" in msg and str(V + 8) in msg and str(V) in msg, msg
    # positive control: the same kind of directory with the target's vocabulary builds a drafter
    same = tiny_config(V, num_layers=1)
    good = save_hf_llama(str(tmp_path / "draft_v40"), same, tiny_params(same, seed=1))
    drafter, dparams = drafter_for(
        llm, SpeculativeConfig(method="draft_model", model=good, num_speculative_tokens=3))
    assert drafter.config.vocab_size == V and drafter.tree.num_nodes == 4 and "params" in dparams


def test_unknown_method_suggests_the_closest(llm):
    with pytest.raises(ConfigError) as e:
        gen(llm, {"method": "ngarm"})
    msg = one_line(e)
    assert "did you mean 'ngram'" in msg, msg
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_user({"method": "draft-model", "model": "x"})
    assert "did you mean 'draft_model'" in one_line(e)
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_user({"metod": "ngram"})
    assert "did you mean 'method'" in one_line(e)


def test_ngram_min_above_max(llm):
    with pytest.raises(ConfigError) as e:
        gen(llm, {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    msg = one_line(e)
    assert "prompt_lookup_min" in msg and "prompt_lookup_max" in msg, msg
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="ngram", prompt_lookup_min=0)
    with pytest.raises(ValueError, match="prompt_lookup"):
        NgramDrafter(4, min_n=3, max_n=2)
    assert NgramDrafter(4, min_n=2, max_n=2).tree.num_nodes == 5


def test_draft_model_without_a_model(llm):
    with pytest.raises(ConfigError) as e:
        gen(llm, {"method": "draft_model", "num_speculative_tokens": 3})
    msg = one_line(e)
    assert "model" in msg and "draft_model" in msg, msg
    with pytest.raises(SpeculativeConfigError) as e:
        resolve_draft_path(None)
    one_line(e)


def test_draft_model_path_that_does_not_exist(llm, tmp_path):
    missing = str(tmp_path / "no_such_draft")
    with pytest.raises(SpeculativeConfigError) as e:
        gen(llm, {"method": "draft_model", "model": missing})
    msg = one_line(e)
    assert missing in msg, msg
