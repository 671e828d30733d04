"""specjax's configs: the model, sampling, speculation and backend sections, and the CLI's RunConfig.

Each is a frozen dataclass (hashable, so a static argument to `jax.jit`) that type-checks and canonicalizes its
fields on construction (`specjax.config.machinery`) and raises a one-line `ConfigError` naming the bad key and
the fix. `load_run_config` builds the command line's config from the packaged YAML files.
"""
from __future__ import annotations

import functools
import math
import pathlib
import types
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal, Optional, Union

from specjax.config.files import package_root, load_yaml, load_yaml_dict, packaged_config_path
from specjax.config.machinery import (ConfigError, coerce, init_params, invalid, normalize, unknown_key,
                                      apply_overrides, from_dict, merge)

__all__ = [
    "ModelConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "BackendConfig",
    "RunConfig",
    "SPECULATIVE_METHODS",
    "MAX_LOGPROBS",
    "load_run_config",
]


SPECULATIVE_METHODS = ("draft_model", "ngram", "suffix", "medusa", "eagle", "eagle3")
MAX_LOGPROBS = 20  # most log-probabilities per token a request may ask for (vLLM's default cap)


def _suggest_unknown_keys(cls: type) -> type:
    """Make `cls(**kwargs)` with an unknown keyword raise a ConfigError naming the closest real field
    (`SamplingParams(stpo=...)`: did you mean 'stop'?) instead of a bare TypeError. The wrapped __init__ keeps
    its signature (functools.wraps), which `machinery` reads to learn the accepted keys."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names, _ = init_params(cls)
        for key in kwargs:
            if key not in names:
                raise unknown_key(key, "", cls.__name__, names)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _from_user(cls: type, obj: Any, name: str) -> Any:
    """A user's `name` argument as a `cls`: None gives the defaults, a mapping is read strictly (errors located
    under `name`), an instance is kept."""
    if obj is None:
        return cls()
    if isinstance(obj, cls):
        return obj
    if isinstance(obj, Mapping):
        return from_dict(cls, obj, where=name)
    raise ConfigError(f"{name} must be None, a dict or {cls.__name__}, got {type(obj).__name__}")


@_suggest_unknown_keys
@dataclass(frozen=True)
class ModelConfig:
    """Which target model to run. `model` is a registry name (e.g. 'smollm2-135m') or a local path;
    `max_context` caps the KV cache length (None = the model's own limit). `quantization`: None = float weights,
    'int8' (per output channel), 'int4' (`quantization_group_size` inputs per scale and minimum) 'gguf' (a GGUF
    file's own Q8_0 / Q4_0 / Q4_1 blocks) or 'w8a8' (int8 weights and activations through Qwix: lossy, for int8
    matrix units); see specjax.models.quant. `quantize_lm_head`: the LM head too (null: with 'gguf' when the file
    stores it as Q8_0 / Q4_0 / Q4_1, float otherwise). `kv_cache_dtype`: None = the model's dtype,
    'int8' = int8 entries with per-token, per-head scales (see specjax.kv_cache)."""

    model: str = "smollm2-135m"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: the checkpoint's (GGUF: float32)
    max_context: Optional[int] = None
    quantization: Optional[Literal["int8", "int4", "gguf", "w8a8"]] = None
    quantization_group_size: int = 32
    quantize_lm_head: Optional[bool] = None
    kv_cache_dtype: Optional[Literal["int8"]] = None

    def __post_init__(self) -> None:
        normalize(self)
        if not self.model.strip():
            raise invalid("model", self.model, "must name a model; use e.g. 'smollm2-135m' or a local path")
        if self.quantization_group_size < 32 or self.quantization_group_size % 32:
            raise invalid("quantization_group_size", self.quantization_group_size,
                           "must be a positive multiple of 32 that divides the model's input dimensions, e.g. 64")
        if self.max_context is not None and self.max_context < 1:
            raise invalid("max_context", self.max_context,
                           "must be >= 1; use null for the model's own context length")


MAX_INT32 = 2 ** 31 - 1  # token ids, top_k and budgets travel as int32 arrays
MAX_N = 1024  # samples per prompt at most


@_suggest_unknown_keys
@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled; also specjax's public Python sampling API, with vLLM's field names.

    max_new_tokens: tokens to generate at most; `max_tokens` is the same value under vLLM's name, accepted on
        input (`SamplingParams(max_tokens=64)`) and readable (`sp.max_tokens`).
    temperature: 0 = greedy decoding. top_k: 0 = off. top_p: 1 = off. min_p: 0 = off; keeps tokens whose
        probability is at least min_p times the most likely token's.
    seed: None (the default) = fresh randomness: each request draws its own seed on the host when it is
        submitted, recorded in its output (`CompletionOutput.seed`); an integer makes sampling reproducible.
    stop: stop strings (one string or a list); the output text is cut before the first one, which is not
        included (unless include_stop_str_in_output), and finish_reason is "stop".
    stop_token_ids: extra token ids that end generation (kept in the output, like the end-of-sequence token).
    ignore_eos: keep generating past the tokenizer's end tokens.
    n: samples per prompt; sample i uses seed + i (or its own fresh seed when seed is None).
    min_tokens: the stop ids and stop strings cannot end generation before this many tokens.
    logprobs: None = none; k = the log-probability of each emitted token plus the k most likely ones, under
        the processed distribution (`specjax.sampling.process_logits`) sampling drew from.
    presence_penalty / frequency_penalty / repetition_penalty: vLLM's penalties; 0, 0 and 1 = off. Repetition
        divides positive and multiplies negative logits of tokens in the prompt or the output; frequency
        subtracts per occurrence in the output, presence once per token present (`specjax.sampling.penalize`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[str, tuple[str, ...]] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: InitVar[Optional[int]] = None

    # Alternative key names accepted by from_dict / merge / apply_overrides (not a dataclass field).
    _config_aliases = types.MappingProxyType({"max_tokens": "max_new_tokens"})

    def __post_init__(self, max_tokens: Optional[int]) -> None:
        if isinstance(self.stop, str):
            # vLLM accepts one stop string as a plain string.
            object.__setattr__(self, "stop", (self.stop,))
        normalize(self)
        if max_tokens is not None:
            max_tokens = coerce(int, max_tokens, "max_tokens")
            default = SamplingParams.__dataclass_fields__["max_new_tokens"].default
            if self.max_new_tokens not in (default, max_tokens):
                raise invalid("max_tokens", max_tokens,
                               f"conflicts with max_new_tokens={self.max_new_tokens}; give only one of them")
            object.__setattr__(self, "max_new_tokens", max_tokens)
        if self.max_new_tokens < 1:
            raise invalid("max_new_tokens", self.max_new_tokens, "must be >= 1; ask for at least one token")
        if self.max_new_tokens > MAX_INT32:
            raise invalid("max_new_tokens", self.max_new_tokens, "must be < 2**31 (and fit the model's context)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise invalid("temperature", self.temperature,
                           "must be a finite number >= 0; use 0 for greedy decoding or e.g. 0.7 to sample")
        if self.top_k < 0:
            raise invalid("top_k", self.top_k, "must be >= 0; use 0 to switch top-k filtering off")
        if self.top_k > MAX_INT32:
            raise invalid("top_k", self.top_k, "must be < 2**31; any value past the vocabulary size keeps every "
                                                "token, and 0 switches top-k off")
        if not (0 < self.top_p <= 1):
            raise invalid("top_p", self.top_p, "must be in (0, 1]; use 1.0 to switch nucleus sampling off")
        if not (0 <= self.min_p <= 1):
            raise invalid("min_p", self.min_p, "must be in [0, 1]; use 0.0 to switch min-p filtering off")
        if self.seed is not None and self.seed < 0:
            raise invalid("seed", self.seed, "must be >= 0; use a non-negative integer, or null for a fresh seed")
        for i, text in enumerate(self.stop):
            if not text:
                raise invalid(f"stop[{i}]", text, "stop strings must be non-empty; remove the empty one")
        for i, tok in enumerate(self.stop_token_ids):
            if tok < 0 or tok > MAX_INT32:
                raise invalid(f"stop_token_ids[{i}]", tok, "token ids must be in [0, 2**31)")
        if self.n < 1 or self.n > MAX_N:
            raise invalid("n", self.n, f"must be in [1, {MAX_N}] (samples per prompt)")
        if self.min_tokens < 0:
            raise invalid("min_tokens", self.min_tokens, "must be >= 0; use 0 to let generation stop at once")
        if self.min_tokens > self.max_new_tokens:
            raise invalid("min_tokens", self.min_tokens,
                           f"must be <= max_new_tokens={self.max_new_tokens}; lower it or raise max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise invalid("logprobs", self.logprobs,
                           f"must be in [0, {MAX_LOGPROBS}] (top log-probabilities per token) or null for none")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise invalid(name, value, "must be in [-2, 2]; use 0.0 to switch it off")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise invalid("repetition_penalty", self.repetition_penalty,
                           "must be a finite number > 0; use 1.0 to switch it off")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of presence / frequency / repetition penalty is switched on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_user(cls, obj: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """None (defaults), a dict such as {"temperature": 0.7, "max_tokens": 64}, or an instance."""
        return _from_user(cls, obj, "sampling_params")


# `max_tokens` reads back as max_new_tokens. A property set after the dataclass is built: the generated __init__
# keeps the InitVar's own default (None), and InitVars are never stored on the instance, so reads reach this.
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens,
                                     doc="vLLM's name for max_new_tokens (the same value).")


MAX_DRAFT_TOKENS = 64  # num_speculative_tokens, tree depth and top_k at most
MAX_TREE_NODES = 256  # total_tokens and suffix_max_depth at most


@_suggest_unknown_keys
@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM-compatible key names where vLLM has them).

    method: None (plain decoding) or one of SPECULATIVE_METHODS.
    num_speculative_tokens: gamma, tokens drafted per step (for medusa: the number of heads).
    model: draft model name/path (draft_model) or head checkpoint path (medusa / eagle / eagle3).
    prompt_lookup_min/max: n-gram sizes matched against the context (ngram). The minimum is 3 by default: on
        13 Spec-Bench prompts 1- and 2-token matches proposed more often and were accepted less (first-token
        acceptance 0.54 against 0.67 with min 3), so more verify steps were paid for fewer tokens
        (reports/spec_bench_cpu/lookup_tuning/).
    suffix_*: suffix-tree drafter limits (suffix).
    tree_choices: a static token tree as paths of top-k ranks, e.g. ((0,), (1,), (0, 0)); must be prefix-closed.
    top_k / depth / total_tokens: dynamic draft tree shape (eagle / eagle3).
    lookup_tokens: eagle / eagle3 / medusa: where the context holds an n-gram match (prompt_lookup_min/max), up
        to this many looked-up tokens become the first branch of the head's tree, in place of its last nodes
        (same node budget, so the same verify cost; `specjax.drafters.with_lookup`). 0 = the head alone.
    acceptance: 'lossless' (exact target distribution) or 'typical' (Medusa typical acceptance; lossy, see
        `is_lossy`); typical_posterior_* are its threshold and alpha.
    adaptive: per-sequence back-off (`backoff.Adaptive`): a sequence whose accepted tokens per verify step
        stay below the break-even measured on this hardware decodes plainly and probes again later;
        False = always speculate.
    dtype / quantization (draft_model; vLLM's key name for the latter): how the draft model is loaded, for
        drafting only (they change the draft's q, never the output): None = the target's dtype / float weights;
        'gguf' keeps a GGUF draft's blocks as stored (native CPU kernels), 'int8' / 'int4' requantize it.
    draft_vocab_size (draft_model): restrict the draft's LM head to the N target tokens most frequent in generated
        text (a ranked id list shipped per tokenizer, `specjax.drafters.draft_vocab`); q is renormalised over them,
        0 elsewhere, so acceptance stays exact. 0 = the draft's whole vocabulary.
    p_min (draft_model): stop drafting a row's chain at the first drafted token whose draft probability is below
        this (llama.cpp's p_min); 0 = always draft num_speculative_tokens. A traced value: changing it compiles
        nothing.
    """

    method: Optional[Literal[SPECULATIVE_METHODS]] = None  # the one list of method names
    num_speculative_tokens: int = 4
    model: Optional[str] = None
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 3
    suffix_max_depth: int = 24
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    tree_choices: Optional[tuple[tuple[int, ...], ...]] = None
    top_k: int = 8
    depth: int = 5
    total_tokens: int = 32
    lookup_tokens: int = 0
    acceptance: Literal["lossless", "typical"] = "lossless"
    typical_posterior_threshold: float = 0.09
    typical_posterior_alpha: float = 0.3
    adaptive: bool = True
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    quantization: Optional[Literal["int8", "int4", "gguf"]] = None
    draft_vocab_size: int = 0
    p_min: float = 0.0

    def __post_init__(self) -> None:
        normalize(self)
        if self.num_speculative_tokens < 1:
            raise invalid("num_speculative_tokens", self.num_speculative_tokens,
                           "must be >= 1 (tokens drafted per step); use method: null to switch speculation off")
        # Upper bounds: acceptance decays geometrically with depth, so drafts this long never pay, while their
        # programs take minutes to compile and gigabytes to run.
        for name, most in (("num_speculative_tokens", MAX_DRAFT_TOKENS), ("suffix_max_depth", MAX_TREE_NODES),
                           ("depth", MAX_DRAFT_TOKENS), ("top_k", MAX_DRAFT_TOKENS),
                           ("total_tokens", MAX_TREE_NODES)):
            if getattr(self, name) > most:
                raise invalid(name, getattr(self, name), f"must be <= {most}: drafts this large never pay back "
                                                          "their verify cost (typical values are 2-8, trees 8-64)")
        if self.method == "draft_model" and not self.model:
            raise invalid("model", self.model,
                           "method 'draft_model' needs a draft model; set model to a model name or local path")
        if self.method is None and self.model is not None:
            raise invalid("model", self.model,
                           "is set but method is null; set method (e.g. 'draft_model') or model: null")
        if self.model is not None and not self.model.strip():
            raise invalid("model", self.model, "must not be empty; use null for no model")
        if self.prompt_lookup_min < 1:
            raise invalid("prompt_lookup_min", self.prompt_lookup_min, "must be >= 1 (n-gram length)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise invalid("prompt_lookup_min", self.prompt_lookup_min,
                           f"must be <= prompt_lookup_max={self.prompt_lookup_max}; lower it or raise the max")
        if self.suffix_max_depth < 1:
            raise invalid("suffix_max_depth", self.suffix_max_depth, "must be >= 1")
        if not (0 <= self.suffix_min_token_prob <= 1):
            raise invalid("suffix_min_token_prob", self.suffix_min_token_prob, "must be in [0, 1]")
        if not (math.isfinite(self.suffix_max_spec_factor) and self.suffix_max_spec_factor > 0):
            raise invalid("suffix_max_spec_factor", self.suffix_max_spec_factor, "must be a finite number > 0")
        for name in ("top_k", "depth", "total_tokens"):
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "must be >= 1 (draft tree shape)")
        if self.tree_choices is not None:
            _check_tree(self.tree_choices)
        if self.lookup_tokens < 0:
            raise invalid("lookup_tokens", self.lookup_tokens, "must be >= 0 (0 = no lookup branch)")
        if self.lookup_tokens and self.method not in ("eagle", "eagle3", "medusa", "draft_model"):
            raise invalid("lookup_tokens", self.lookup_tokens,
                           f"merges a lookup branch into a drafter's proposal, so it needs method eagle, eagle3, "
                           f"medusa or draft_model (got {self.method!r}); for lookups alone use method 'ngram'")
        if self.lookup_tokens > MAX_DRAFT_TOKENS:
            raise invalid("lookup_tokens", self.lookup_tokens, f"must be <= {MAX_DRAFT_TOKENS}")
        for name in ("dtype", "quantization"):
            if getattr(self, name) is not None and self.method != "draft_model":
                raise invalid(name, getattr(self, name), f"sets how a draft model is loaded, so it needs method "
                                                          f"'draft_model' (got {self.method!r})")
        if self.draft_vocab_size < 0:
            raise invalid("draft_vocab_size", self.draft_vocab_size, "must be >= 0 (0 = the whole vocabulary)")
        if self.draft_vocab_size and self.method != "draft_model":
            raise invalid("draft_vocab_size", self.draft_vocab_size,
                           f"trims a draft model's LM head, so it needs method 'draft_model' (got {self.method!r})")
        if not (math.isfinite(self.p_min) and 0 <= self.p_min < 1):
            raise invalid("p_min", self.p_min, "must be in [0, 1) (0 = draft every token)")
        if self.p_min and self.method != "draft_model":
            raise invalid("p_min", self.p_min,
                           f"stops a draft model's chain early, so it needs method 'draft_model' (got {self.method!r})")
        if not (0 < self.typical_posterior_threshold <= 1):
            raise invalid("typical_posterior_threshold", self.typical_posterior_threshold, "must be in (0, 1]")
        if not (0 <= self.typical_posterior_alpha <= 1):
            raise invalid("typical_posterior_alpha", self.typical_posterior_alpha, "must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        """True when a speculative method is selected."""
        return self.method is not None

    @property
    def is_lossy(self) -> bool:
        """True iff acceptance is 'typical': outputs may then differ from the target model's distribution."""
        return self.acceptance == "typical"

    @classmethod
    def from_user(cls, obj: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig":
        """None (no speculation), a vLLM-style dict such as
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, or an instance."""
        return _from_user(cls, obj, "speculative_config")


def _check_tree(choices: tuple[tuple[int, ...], ...]) -> None:
    seen = set()
    for i, path in enumerate(choices):
        where = f"tree_choices[{i}]"
        if not path:
            raise invalid(where, list(path), "tree paths must be non-empty lists of top-k ranks")
        if any(r < 0 for r in path):
            raise invalid(where, list(path), "top-k ranks must be >= 0")
        if path in seen:
            raise invalid(where, list(path), "duplicate tree path; list each node once")
        seen.add(path)
    for i, path in enumerate(choices):
        parent = path[:-1]
        if parent and parent not in seen:
            raise invalid(f"tree_choices[{i}]", list(path),
                           f"its parent {list(parent)} is missing; every prefix of a path must be listed too")


@_suggest_unknown_keys
@dataclass(frozen=True)
class BackendConfig:
    """Where to run. backend 'auto' picks the best available JAX platform; attention_impl names an attention
    kernel ('auto' = the backend's default); mesh runs over a device mesh, e.g. 'data=2,model=4' (None = one
    device; see specjax.mesh)."""

    backend: Literal["auto", "cpu", "gpu", "tpu", "neuron"] = "auto"
    attention_impl: str = "auto"
    mesh: Optional[str] = None

    def __post_init__(self) -> None:
        normalize(self)
        if not self.attention_impl.strip():
            raise invalid("attention_impl", self.attention_impl, "must not be empty; use 'auto'")
        if self.mesh is not None and not self.mesh.strip():
            raise invalid("mesh", self.mesh, "must name the axes, e.g. 'data=2,model=4'; use null for one device")


@_suggest_unknown_keys
@dataclass(frozen=True)
class RunConfig:
    """The command line's top-level config: one YAML file (configs/default.yaml) maps onto it. Sections left out
    of a YAML file keep their defaults, so a method file only needs its `speculative:` section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    batch_size: int = 1
    prompts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        normalize(self)
        if self.batch_size < 1:
            raise invalid("batch_size", self.batch_size, "must be >= 1")


def load_run_config(config: Optional[str | pathlib.Path] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The CLI's config: packaged `default.yaml`, then `config` (a packaged name such as 'methods/ngram' or a
    file path) merged over it, then `key=value` overrides."""
    root = package_root()
    default = root / "default.yaml" if root is not None else None
    cfg = load_yaml(RunConfig, default) if default is not None and default.is_file() else RunConfig()
    if config is not None:
        path = packaged_config_path(config)
        try:
            cfg = merge(cfg, load_yaml_dict(path))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    return apply_overrides(cfg, overrides)
