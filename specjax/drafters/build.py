"""Method -> drafter: `build_drafter(spec, target_params, target_config, dtype)` -> (drafter, dparams).

Pure (no cache: `runners.runtime.SpecRuntime.drafter` keeps what it builds). Loading a specjax-trained draft
goes through `specjax.models.draft_io`, never through specjax.train: inference does not import training.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp

from specjax import acceptance
from specjax.config import SPECULATIVE_METHODS
from specjax.drafters.base import find_packaged
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import SpecjaxError
from specjax.models.llama import fuse_projections

class SpeculativeConfigError(SpecjaxError, ValueError):
    """The speculative configuration cannot be used with this target model."""


def build_drafter(spec, target_params: dict, target_config, dtype: str = "float32") -> tuple:
    """(drafter, dparams) for a SpeculativeConfig and the target it drafts for.

    target_params: the target's (fused) params; heads share its embedding / lm_head, a draft model casts to its
    dtype. target_config: its LlamaConfig. dtype: the dtype a Hugging Face draft model is loaded in.
    """
    g = spec.num_speculative_tokens
    if spec.method == "ngram":
        built = NgramDrafter(g, spec.prompt_lookup_min, spec.prompt_lookup_max), {}
    elif spec.method == "draft_model":
        built = _draft_model(spec, target_params, target_config, dtype)
    elif spec.method == "suffix":
        from specjax.drafters.suffix import SuffixDrafter

        built = SuffixDrafter.from_config(spec), {}
    elif spec.method == "medusa":
        from specjax.drafters import medusa

        built = medusa.load(spec.model, target_params, target_config.hidden_size, target_config.vocab_size,
                            num_speculative_tokens=g, tree_choices=spec.tree_choices,
                            acceptance_rule=spec.acceptance,
                            typical_posterior_threshold=spec.typical_posterior_threshold,
                            typical_posterior_alpha=spec.typical_posterior_alpha)
    elif spec.method in ("eagle", "eagle3"):
        from specjax.drafters.eagle import load_eagle_drafter, resolve_head_path

        built = load_eagle_drafter(resolve_head_path(spec.model, spec.method), spec.method, target_config,
                                   target_params, top_k=spec.top_k, depth=spec.depth, total_tokens=spec.total_tokens)
    else:
        raise SpeculativeConfigError(
            f"speculative method {spec.method!r} is not available in this build of specjax; "
            f"available: {', '.join(repr(m) for m in SPECULATIVE_METHODS)}")
    built = _with_acceptance(built, spec)
    if spec.lookup_tokens:
        from specjax.drafters.with_lookup import DraftWithLookup, WithLookup

        lookup = NgramDrafter(spec.lookup_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        merged = DraftWithLookup.around if spec.method == "draft_model" else WithLookup
        built = merged(built[0], lookup), built[1]
    return built


def _with_acceptance(built, spec):
    """Apply `acceptance: typical` (lossy, opt-in) to a drafter whose candidates are deterministic."""
    drafter, dparams = built
    if spec.acceptance != "typical" or isinstance(drafter.mode, acceptance.TypicalMode):
        return built
    if drafter.mode != "deterministic":
        raise SpeculativeConfigError(
            f"acceptance 'typical' needs deterministic drafts (medusa, eagle, eagle3, ngram, suffix); method "
            f"{spec.method!r} samples its drafts, so use acceptance 'lossless'")
    mode = acceptance.TypicalMode(spec.typical_posterior_threshold, spec.typical_posterior_alpha)
    return dataclasses.replace(drafter, mode=mode), dparams


def _draft_model(spec, target_params: dict, target_config, dtype: str):
    """The draft model of `spec`, loaded as its `dtype` / `quantization` say (default: the target's dtype, float
    weights), its LM head trimmed to `draft_vocab_size` tokens, its `p_min` in dparams (traced)."""
    from specjax.models import quant
    from specjax.models.loading import cast_float_leaves, load_model, resolve_model

    path = resolve_draft_path(spec.model)
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else None
    d2t = None
    if cfg_file and "specjax_draft" in pathlib.Path(cfg_file).read_text():
        from specjax.models.draft_io import load_draft

        if spec.quantization == "gguf":
            raise SpeculativeConfigError(f"draft model {spec.model!r} is a specjax draft directory, not a GGUF file: "
                                         "quantization 'gguf' keeps a GGUF file's blocks; use 'int8' or 'int4'")
        config, params, d2t = load_draft(path, target_params)
        _check_vocab(spec, config, target_config, "was built for")
        if spec.quantization is None:
            ddtype = spec.dtype or target_params["embed"].dtype
            params = fuse_projections(jax.tree_util.tree_map(lambda a: a.astype(ddtype), params))
        else:
            fused = fuse_projections(jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params))
            # Every matrix, the LM head included: a requantized draft is for drafting only.
            params = cast_float_leaves(quant.quantize_params(fused, spec.quantization, lm_head=True),
                                       spec.dtype or str(target_params["embed"].dtype))
    else:
        resolve_model(path)
        # int8 / int4 requantize every matrix, the LM head included (drafting only); 'gguf' keeps the file's.
        loaded = load_model(path, spec.dtype or dtype, with_tokenizer=False, quantization=spec.quantization,
                            quantize_lm_head=True if spec.quantization in ("int8", "int4") else None)
        config = loaded.config
        _check_vocab(spec, config, target_config, "has")
        params = fuse_projections(loaded.params)
    if spec.draft_vocab_size:
        from specjax.drafters.draft_model import trim_vocab
        from specjax.drafters.draft_vocab import DraftVocabError, ranked_ids

        try:
            keep = ranked_ids(target_config.vocab_size, spec.draft_vocab_size)
        except DraftVocabError as e:
            raise SpeculativeConfigError(str(e)) from None
        params, d2t = trim_vocab(params, d2t, keep)
    dparams = {"params": params, "p_min": jnp.float32(spec.p_min)}
    if d2t is not None:
        dparams["d2t"] = jnp.asarray(d2t, jnp.int32)
    return DraftModelDrafter(config, spec.num_speculative_tokens, target_config.vocab_size), dparams


def _check_vocab(spec, config, target_config, verb: str) -> None:
    if config.vocab_size != target_config.vocab_size:
        raise SpeculativeConfigError(
            f"draft model {spec.model!r} {verb} a vocabulary of {config.vocab_size} tokens, the target has "
            f"{target_config.vocab_size}; a draft must share the target's tokenizer")


def resolve_draft_path(model: str | None) -> str:
    """A draft path as given, relative to the installed package (the shipped `assets/...` drafts), or another
    name the model resolver knows: an alias such as 'qwen2.5-coder-0.5b' or a Hugging Face Hub id."""
    if model is None:
        raise SpeculativeConfigError("method 'draft_model' needs `model`: the path of the draft model")
    found, packaged = find_packaged(model)
    if found is not None:
        return found
    from specjax.models.resolve import ALIASES, parse_hub_id, resolve

    if model.strip().lower() in ALIASES or parse_hub_id(model) is not None:
        return resolve(model).path
    raise SpeculativeConfigError(f"draft model path {model!r} does not exist (also looked in {packaged})")
