"""The Python API: `LLM(model=...)` and `llm.generate(prompts, SamplingParams(...), speculative_config=...)`.

A thin facade: it loads the model, normalises and tokenizes the prompts (`specjax.requests`) and hands them to
the one host driver (`runners.base.generate`) with the variant that fits: plain (`runners.plain`), speculative
(`runners.speculative`) or the Neuron policy (`runners.neuron`). Between calls it keeps only `runtime`, the
speculative caches (built drafters, measured break-evens) and learned values.
"""
from __future__ import annotations

from typing import Callable

import jax

from specjax import requests
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.models.loading import DEFAULT_MODEL, load_model
from specjax.models.llama import fuse_projections
# Re-exported: `from specjax.api import RequestOutput, pad_prompts, ...` keeps working.
from specjax.requests import (FINISH_NAMES, PromptLike, RequestError, RequestMetrics, RequestOutput,  # noqa: F401
                              pad_prompts)
from specjax.runners.runtime import SpecRuntime
from specjax.sampling import SamplingArrays


class LLM:
    """A loaded model ready to generate: config, params, tokenizer, and `runtime` (the speculative caches and
    learned values, `runners.runtime.SpecRuntime`)."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", *, backend: str = "auto",
                 attention_impl: str = "auto", max_context: int | None = None, attention_interpret: bool = False):
        """backend: 'auto' | 'cpu' | 'gpu' | 'tpu' run the default program; 'neuron' runs the Neuron-policy
        program (fused unrolled steps looped from the host, buckets compiled ahead of time), on CPU when the
        Neuron SDK is absent. attention_interpret runs Pallas kernels in interpret mode (testing on CPU)."""
        loaded = load_model(model, dtype)
        self.model_spec = model
        self.dtype = dtype
        self.config = loaded.config
        # The inference layout (fused, [out, in] projections): 10-25% faster target forwards on XLA:CPU.
        self.params = fuse_projections(loaded.params)
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.max_context = min(max_context or loaded.config.max_position_embeddings,
                               loaded.config.max_position_embeddings)
        self.backend = backend
        self.attention_impl = attention_impl
        self.attention_fn = resolve_attention(attention_impl, backend, attention_interpret)
        # What speculative generation keeps between calls: built drafters, measured break-evens, learned priors.
        self.runtime = SpecRuntime()

    # ------------------------------------------------------------------------------------ input handling
    def encode_prompt(self, prompt: PromptLike, chat: bool | None) -> list[int]:
        """Token ids of one prompt (text, chat messages or token ids); `chat` wraps text in the chat template."""
        return requests.encode_prompt(self.tokenizer, self.config.vocab_size, prompt, chat)

    def check_request(self, i, ids: list[int], sp: SamplingParams, extra: int = 0) -> None:
        """Raise RequestError unless request `i` (`extra` speculative KV slots included) fits the context."""
        requests.check_request(i, ids, sp, extra, self.max_context)

    def stop_ids(self, sp: SamplingParams) -> list[int]:
        """The request's stop ids: its own plus the tokenizer's end tokens unless ignore_eos."""
        return requests.stop_ids(self.tokenizer, sp)

    def num_stop(self, params: list[SamplingParams]) -> int:
        return requests.num_stop(self.tokenizer, params)

    def sampling_arrays(self, params: list[SamplingParams], batch: int, num_stop: int) -> SamplingArrays:
        return requests.sampling_arrays(self.tokenizer, params, batch, num_stop)

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, speculative_config=None, *, chat: bool | None = None,
                 stream: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch.

        prompts: a string, a list of token ids, a list of chat messages, or a list of any of these.
        sampling_params: one SamplingParams (or dict) for all, or one per prompt.
        speculative_config: None (plain decoding), a dict such as {"method": "ngram", "num_speculative_tokens": 4},
        or a SpeculativeConfig.
        chat: wrap plain-string prompts in the model's chat template (default: no, like vLLM's generate).
        stream: called as stream(prompt_index, new_text) while decoding (plain decoding, from the host).
        """
        prompts, params = requests.normalise(prompts, sampling_params)
        spec = SpeculativeConfig.from_user(speculative_config)
        ids = [self.encode_prompt(p, chat) for p in prompts]
        if self.backend == "neuron":
            from specjax.runners.neuron import generate_neuron

            outs = generate_neuron(self, ids, params, spec if spec.enabled else None)
            for o, p in zip(outs, prompts):
                o.prompt = p
            return outs
        if spec.enabled:
            from specjax.runners import speculative

            return speculative.generate(self, prompts, ids, params, spec)
        from specjax.runners.base import generate as run_variant
        from specjax.runners.plain import PlainVariant

        return run_variant(self, prompts, ids, params, PlainVariant(self, stream))


def resolve_attention(attention_impl: str, backend: str, interpret: bool = False):
    """The verify-attention function for this platform (None = the XLA reference inside the model)."""
    if attention_impl in ("auto", "reference") and backend in ("auto", "cpu", "neuron") and not interpret:
        if attention_impl == "reference" or jax.default_backend() == "cpu":
            return None
    try:
        from specjax.backends.registry import get_attention
    except ImportError as e:  # pragma: no cover - the registry ships with specjax
        raise ConfigError(f"backend registry unavailable: {e}") from None
    return get_attention(attention_impl, interpret=interpret)
