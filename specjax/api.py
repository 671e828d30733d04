"""The Python API, shaped like vLLM's: `LLM(model=..., speculative_config=...)`, `llm.generate(prompts,
SamplingParams(...))`, `llm.chat(messages)`, `llm.warmup()`.

A thin facade: it loads the model, normalises and tokenizes the prompts (`specjax.requests`), turns each request
into one row per sample (`n`, seeds fixed on the host), hands the rows to the one host driver
(`runners.base.generate`) with the variant that fits: plain (`runners.plain`), speculative (`runners.speculative`)
or the Neuron policy (`runners.neuron`); past `max_num_seqs` rows, they queue through the continuous-batching
engine instead (`runners.serving.run_queued`). Then the host-side options: stop
strings cut each sample (`requests.finish_completion`), logprobs come from one teacher-forced forward over prompt
+ output (`score_logprobs`), and the samples of a prompt are gathered into one RequestOutput. Between calls it
keeps only `runtime`, the speculative caches (built drafters, measured break-evens) and learned values.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import requests
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.kv_cache import check_kv_dtype, init_cache
from specjax.models.loading import DEFAULT_MODEL, load_model
from specjax.models.llama import LlamaConfig, forward, fuse_projections
from specjax.requests import CompletionOutput, Logprob, PromptLike, RequestError, RequestOutput
from specjax.runners.runtime import SpecRuntime
from specjax.sampling import SamplingArrays, token_logprobs

Stream = Callable[[int, str], None]


class LLM:
    """A loaded model ready to generate: config, params, tokenizer, the default speculative config and batch
    cap, and `runtime` (the speculative caches and learned values, `runners.runtime.SpecRuntime`)."""

    # Class-level defaults: stand-ins built with LLM.__new__ (tests' tiny models) behave like LLM(...) without them.
    speculative_config = SpeculativeConfig()
    max_num_seqs: int | None = None
    quantization: str | None = None
    quantized_lm_head = False
    kv_cache_dtype: str | None = None
    mesh_plan = None  # a specjax.mesh.ShardingPlan when the model runs over a device mesh

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", *,
                 speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
                 max_num_seqs: int | None = 256, backend: str = "auto", attention_impl: str = "auto",
                 max_context: int | None = None, attention_interpret: bool = False, mesh=None,
                 quantization: str | None = None, quantization_group_size: int = 32,
                 quantize_lm_head: bool | None = None, kv_cache_dtype: str | None = None):
        """dtype: 'float32' | 'bfloat16', or 'auto' (the checkpoint's own: config.json's dtype / torch_dtype for
        a Hugging Face directory, so bf16 stays bf16; float32 for GGUF files); `self.dtype` is the one loaded.
        speculative_config: the default of every generate / chat call (None: plain decoding); a call's own
        speculative_config replaces it. The drafter is built here, so a bad head path fails now.
        max_num_seqs: run at most this many sequences (samples) at once; more wait in a queue and take the
        slot of the next one that finishes (continuous batching; on a mesh, under the Neuron policy or with a
        host-side drafter, successive batches of this size). 256 by default (vLLM's), so a thousand prompts
        never become one batch; None: all in one batch.
        backend: 'auto' | 'cpu' | 'gpu' | 'tpu' run the default program; 'neuron' runs the Neuron-policy
        program (fused unrolled steps looped from the host, buckets compiled ahead of time), on CPU when the
        Neuron SDK is absent. attention_interpret runs Pallas kernels in interpret mode (testing on CPU).
        mesh: run over a device mesh ('data=2,model=4', a dict, a specjax.mesh.MeshConfig or a jax.sharding.Mesh
        with axes data and model; see specjax.mesh): the params are placed at load, tensor-parallel over `model`,
        the batch spread over `data`. None: one device.
        quantization: None (float weights in `dtype`), 'int8' (per output channel), 'int4' (an asymmetric scale
        per quantization_group_size inputs), 'gguf' (a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks) or 'w8a8'
        (int8 weights and activations through Qwix: lossy, for int8 matrix units) for the target's layer projections (specjax.models.quant); speculation runs on top unchanged, and greedy output
        stays that of the same quantized target. quantize_lm_head: the LM head too (None: with 'gguf' when the file
        stores it as Q8_0 / Q4_0 / Q4_1, as llama.cpp reads it; float with the other settings). kv_cache_dtype: None (the target's KV cache in `dtype`), or 'int8'
        (int8 entries with a scale per token and KV head, specjax.kv_cache; on one device, not under the Neuron
        policy); speculation stays exact: greedy output is that of plain decoding over the same int8 cache. The
        drafters' own caches stay in their dtype."""
        spec = SpeculativeConfig.from_user(speculative_config)
        if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int)
                                         or max_num_seqs < 1):
            raise ConfigError(f"invalid max_num_seqs={max_num_seqs!r}: must be an integer >= 1, or None for no cap")
        if mesh is not None and backend == "neuron":
            raise ConfigError("mesh runs the default program; the Neuron policy runs on one device: drop mesh or "
                              "use backend='auto'")
        plan = None
        if mesh is not None:
            from specjax import mesh as meshes

            mesh_config = None if isinstance(mesh, jax.sharding.Mesh) else meshes.MeshConfig.from_user(mesh)
            built = meshes.make_mesh(mesh if mesh_config is None else mesh_config)
        from specjax.models import quant

        quant.check_quantization(quantization)
        quant.check_lm_head(quantization, quantize_lm_head)
        check_kv_dtype(kv_cache_dtype)
        if kv_cache_dtype is not None and backend == "neuron":
            # The Neuron policy compiles its own bucket table (backends.neuron), whose caches are in the params' dtype.
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} runs with the default program only (backend 'auto', "
                              "'cpu', 'gpu' or 'tpu'), not under the Neuron policy: drop kv_cache_dtype or use "
                              "backend='auto'")
        if kv_cache_dtype is not None and mesh is not None:
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} does not run over a device mesh yet (one device "
                              "only): drop mesh or kv_cache_dtype")
        if quantization is not None and mesh is not None:
            raise ConfigError("quantized weights do not run over a device mesh yet: drop mesh or quantization")
        loaded = load_model(model, dtype, quantization=quantization, group_size=quantization_group_size,
                            quantize_lm_head=quantize_lm_head)
        self.model_spec = model
        self.dtype = str(loaded.params["embed"].dtype)  # 'auto' resolved to the checkpoint's
        self.quantization = quantization
        self.quantized_lm_head = "lm_head_q" in loaded.params
        self.kv_cache_dtype = kv_cache_dtype
        self.config = loaded.config
        # The inference layout (fused, [out, in] projections): faster target forwards on XLA:CPU (figures:
        # reports/decode_cpu/README.md, "Fused projections").
        self.params = fuse_projections(loaded.params)
        if mesh is not None:
            plan = meshes.plan_for(loaded.config, built, "auto" if mesh_config is None else mesh_config.attention)
            self.params = meshes.place_params(self.params, loaded.config, plan)
        self.mesh_plan = plan
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.max_context = min(max_context or loaded.config.max_position_embeddings,
                               loaded.config.max_position_embeddings)
        self.backend = backend
        self.attention_impl = attention_impl
        # Sliding-window models (Mistral) verify with the XLA path in the model, the one that applies the window.
        windowed = getattr(loaded.config, "sliding_window", None) is not None and attention_impl == "auto"
        self.attention_fn = None if windowed else resolve_attention(attention_impl, backend, attention_interpret)
        # What speculative generation keeps between calls: built drafters, measured break-evens, learned priors.
        self.runtime = SpecRuntime()
        self.speculative_config = spec
        self.max_num_seqs = max_num_seqs
        if spec.enabled and backend != "neuron":
            from specjax.runners import speculative

            with self.on_mesh():
                speculative.drafter_for(self, spec)

    def on_mesh(self):
        """The context every program of this model traces and runs in: its mesh (`jax.set_mesh`), or nothing."""
        from specjax.mesh import maybe_context

        return maybe_context(self.mesh_plan)

    # ------------------------------------------------------------------------------------ input handling
    def encode_prompt(self, prompt: PromptLike, chat: bool | None, **template: Any) -> list[int]:
        """Token ids of one prompt (text, chat messages or token ids); `chat` wraps text in the chat template.
        `template`: add_generation_prompt / chat_template_kwargs (`requests.encode_prompt`)."""
        return requests.encode_prompt(self.tokenizer, self.config.vocab_size, prompt, chat, **template)

    def check_request(self, i, ids: list[int], sp: SamplingParams, extra: int = 0) -> None:
        """Raise RequestError unless request `i` (`extra` speculative KV slots included) fits the context."""
        requests.check_request(i, ids, sp, extra, self.max_context)

    def stop_ids(self, sp: SamplingParams) -> list[int]:
        """The request's stop ids: its own plus the tokenizer's end tokens unless ignore_eos."""
        return requests.stop_ids(self.tokenizer, sp)

    def num_stop(self, params: list[SamplingParams]) -> int:
        return requests.num_stop(self.tokenizer, params)

    def sampling_arrays(self, params: list[SamplingParams], batch: int, num_stop: int,
                        prompts: list[list[int]] | None = None) -> SamplingArrays:
        return requests.sampling_arrays(self.tokenizer, params, batch, num_stop, prompts, self.config.vocab_size)

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, speculative_config=None, *, chat: bool | None = None,
                 stream: Stream | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch; one RequestOutput per prompt, its `outputs` the n samples.

        prompts: a string, a list of token ids, a list of chat messages, or a list of any of these.
        sampling_params: one SamplingParams (or dict) for all, or one per prompt.
        speculative_config: None = the LLM's own (set at construction; plain decoding by default), a dict such
        as {"method": "ngram", "num_speculative_tokens": 4}, or a SpeculativeConfig; {"method": None} switches
        speculation off for this call.
        chat: wrap plain-string prompts in the model's chat template (default: no, like vLLM's generate).
        stream: called as stream(prompt_index, new_text) while decoding; the pieces of a prompt join to its
        output's text (stop strings are held back until they cannot be one). Needs n = 1.
        """
        prompts, params = requests.normalise(prompts, sampling_params)
        ids = [self.encode_prompt(p, chat) for p in prompts]
        return self._generate(prompts, ids, params, speculative_config, stream)

    def chat(self, messages, sampling_params=None, *, speculative_config=None,
             chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
             stream: Stream | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role': ..., 'content': ...} messages, a system
        message included) or a list of conversations, rendered with the model's chat template;
        chat_template_kwargs are passed to the template (e.g. {"enable_thinking": False}). The other arguments
        are generate's. Returns one RequestOutput per conversation."""
        convs = requests.conversations(messages)
        params = requests.per_prompt_params(sampling_params, len(convs))
        ids = [self.encode_prompt(c, True, add_generation_prompt=add_generation_prompt,
                                  chat_template_kwargs=chat_template_kwargs) for c in convs]
        return self._generate(convs, ids, params, speculative_config, stream)

    def warmup(self, max_tokens: int = 128, speculative_config=None, *, prompt_tokens: int = 64,
               batch_size: int = 1) -> float:
        """Compile the programs of a typical request ahead of the first real call: `batch_size` prompts of
        `prompt_tokens` tokens, up to `max_tokens` new tokens each, with `speculative_config` (None = the LLM's
        own). A later generate whose shapes round to the same buckets (prompt and output lengths round up to
        powers of two, batch too) compiles nothing. With speculation it also measures the back-off break-even;
        the learned values (suffix index, gain priors) are restored afterwards, so the dummy prompts teach
        nothing. Returns the seconds it took."""
        t0 = time.perf_counter()
        # Token ids cycling over the vocabulary's first ids: no tokenizer involved, never a stop id under ignore_eos.
        ids = [[(i % max(1, self.config.vocab_size - 1)) + 1 for i in range(prompt_tokens)]] * batch_size
        sp = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, seed=0)
        saved = self.runtime.learned_state()
        try:
            self._generate(ids, ids, [sp] * batch_size, speculative_config, None)
        finally:
            self.runtime.restore_learned(saved)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------ the request pipeline
    def _generate(self, prompts: list, ids: list[list[int]], params: list[SamplingParams], speculative_config,
                  stream: Stream | None) -> list[RequestOutput]:
        """Rows per sample -> batches of at most max_num_seqs -> runner -> stop strings, logprobs -> one
        RequestOutput per prompt."""
        spec = (self.speculative_config if speculative_config is None
                else SpeculativeConfig.from_user(speculative_config))
        if stream is not None and any(p.n > 1 for p in params):
            raise RequestError("stream hands out one text per prompt, so it needs n = 1; drop n or the stream")
        rows, owners = requests.expand_samples(params)
        row_ids = [ids[i] for i, _ in owners]
        cap = self.max_num_seqs or len(rows)
        if len(rows) > cap:
            # Every request checked before the first batch runs: a bad one fails now, not after hours of work.
            requests.check_requests(row_ids, rows, self._extra_slots(spec), self.max_context)
        if len(rows) > cap and self._can_queue(spec):
            return _gather(prompts, ids, owners, self._queued(row_ids, rows, owners, spec, cap, stream))
        holds = [requests.StopStream(sp.stop) if stream is not None and sp.stop else None for sp in rows]
        comps: list[CompletionOutput] = []
        for start in range(0, len(rows), cap):
            part = slice(start, start + cap)
            row_stream = None if stream is None else _row_stream(stream, owners, holds, start)
            with self.on_mesh():
                outs = self._run(row_ids[part], row_ids[part], rows[part], spec, row_stream)
            for r, o in enumerate(outs, start):
                sp = rows[r]
                comp = requests.finish_completion(self.tokenizer, o.outputs[0], sp)
                comp.index, comp.seed = owners[r][1], sp.seed
                if sp.logprobs is not None:
                    comp.cumulative_logprob, comp.logprobs = self.score_logprobs(row_ids[r], comp.token_ids, sp)
                if holds[r] is not None:
                    rest = holds[r].close(comp.text)
                    if rest:
                        stream(owners[r][0], rest)
                comps.append(comp)
        return _gather(prompts, ids, owners, comps)

    def _can_queue(self, spec: SpeculativeConfig) -> bool:
        """Whether rows past max_num_seqs can queue through the continuous-batching engine: a single-device
        model on the XLA backends with plain decoding or a device-side drafter. Otherwise they run in successive
        batches of max_num_seqs."""
        if self.backend == "neuron" or self.mesh_plan is not None:
            return False
        if not spec.enabled:
            return True
        from specjax.runners import speculative

        return not speculative.drafter_for(self, spec)[0].capabilities.host_side

    def _queued(self, row_ids: list[list[int]], rows: list[SamplingParams], owners, spec: SpeculativeConfig,
                cap: int, stream: Stream | None) -> list[CompletionOutput]:
        """Every row through `runners.serving.run_queued`, at most `cap` at once; the completions in row order."""
        from specjax import compile_time
        from specjax.runners.base import SPEC_STREAM_CHUNK, STREAM_CHUNK
        from specjax.runners.serving import run_queued

        # The engine scores no logprobs: they come from one teacher-forced pass after generation, as for a batch.
        plain_rows = [dataclasses.replace(sp, logprobs=None) for sp in rows]
        on_text = None if stream is None else (lambda r, text: stream(owners[r][0], text))
        with compile_time.watch(compile_time.say) as ct:
            results = run_queued(self, row_ids, plain_rows, spec if spec.enabled else None, cap, on_text,
                                 step_chunk=32 if stream is None else SPEC_STREAM_CHUNK if spec.enabled else STREAM_CHUNK,
                                 progress=compile_time.progress_enabled())
        comps = []
        for r, (res, sp) in enumerate(zip(results, rows)):
            spec_fields = dict(res.spec or {}, draft_time=None, verify_time=None) if res.spec is not None else {}
            metrics = requests.RequestMetrics(
                prompt_tokens=res.prompt_tokens, new_tokens=res.completion_tokens,
                time_to_first_token=res.time_to_first_token, total_time=res.e2e_latency,
                tokens_per_s=res.completion_tokens / res.e2e_latency if res.e2e_latency > 0 else float("nan"),
                compile_time=ct.total, **spec_fields)
            if res.finish_reason == "error":
                requests.warn_nonfinite(res.completion_tokens)
            comp = CompletionOutput(owners[r][1], res.text, list(res.token_ids), None, None, res.finish_reason,
                                    res.stop_reason, res.seed, metrics)
            if sp.logprobs is not None:
                comp.cumulative_logprob, comp.logprobs = self.score_logprobs(row_ids[r], comp.token_ids, sp)
            comps.append(comp)
        return comps

    def _run(self, prompts, ids, params, spec: SpeculativeConfig, stream: Stream | None) -> list[RequestOutput]:
        """One batch of rows (n = 1 each) through the runner that fits."""
        if self.backend == "neuron":
            from specjax.runners.neuron import generate_neuron

            if stream is not None:
                raise RequestError("the Neuron policy does not stream; drop stream or use another backend")
            return generate_neuron(self, ids, params, spec if spec.enabled else None)
        if spec.enabled:
            from specjax.runners import speculative

            return speculative.generate(self, prompts, ids, params, spec, stream=stream)
        from specjax.runners.base import generate as run_variant
        from specjax.runners.plain import PlainVariant

        return run_variant(self, prompts, ids, params, PlainVariant(self, stream))

    def _extra_slots(self, spec: SpeculativeConfig) -> int:
        """KV slots a speculative step writes past the committed length (the drafter's tree size)."""
        if not spec.enabled or self.backend == "neuron":
            return 0
        from specjax.runners import speculative

        return speculative.drafter_for(self, spec)[0].tree.num_nodes

    # ------------------------------------------------------------------------------------ logprobs
    def score_logprobs(self, prompt_ids: Sequence[int], token_ids: Sequence[int],
                       sp: SamplingParams) -> tuple[float | None, list[dict[int, Logprob]] | None]:
        """(cumulative logprob, per-token {token id: Logprob}) of `token_ids` after `prompt_ids` under the target's
        processed distribution for `sp` (`sampling.token_logprobs`: greedy scored at temperature 1), with the
        emitted token and the sp.logprobs most likely ones at every position. One teacher-forced forward over
        prompt + output, after generation: the values depend on the tokens only, never on the decoding method
        (plain, any drafter), and each is the distribution that token was drawn from. (None, None) when
        sp.logprobs is None; ([], 0.0) for no tokens."""
        if sp.logprobs is None:
            return None, None
        out = [int(t) for t in token_ids]
        if not out:
            return 0.0, []
        seq = list(prompt_ids) + out
        P, N = len(prompt_ids), len(out)
        T, Nb, k = _bucket(len(seq), 16), _bucket(N, 16), _bucket(max(sp.logprobs, 1), 1)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(seq)] = seq
        positions = np.zeros((1, Nb), np.int32)
        positions[0, :N] = np.arange(P - 1, P - 1 + N)
        targets = np.zeros((1, Nb), np.int32)
        targets[0, :N] = out
        sampling = requests.sampling_arrays(self.tokenizer, [sp], 1, max(1, requests.num_stop(self.tokenizer, [sp])),
                                            [list(prompt_ids)], self.config.vocab_size)
        with self.on_mesh():
            chosen, rank, vals, top = jax.device_get(_score_tokens(self.params, self.config, jnp.asarray(tokens),
                                                                   jnp.asarray(positions), jnp.asarray(targets),
                                                                   sampling, k, self.kv_cache_dtype))
        decode = functools.lru_cache(maxsize=None)(lambda t: self.tokenizer.decode([t]))
        steps = []
        for j, tok in enumerate(out):
            entry = {int(t): Logprob(float(v), r + 1, decode(int(t)))
                     for r, (v, t) in enumerate(zip(vals[0, j, :sp.logprobs], top[0, j, :sp.logprobs]))}
            if tok not in entry:
                entry[tok] = Logprob(float(chosen[0, j]), int(rank[0, j]), decode(tok))
            steps.append(entry)
        return float(np.sum(chosen[0, :N], dtype=np.float64)), steps


def _bucket(n: int, minimum: int) -> int:
    """n rounded up to a power of two, at least `minimum`: the scorer compiles once per bucket, not per length."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "k", "kv_dtype"))
def _score_tokens(params, config: LlamaConfig, tokens, positions, targets, sampling: SamplingArrays, k: int,
                  kv_dtype: str | None = None):
    """token_logprobs of targets [1, N] at logit positions [1, N] of one causal forward over tokens [1, T], over a
    KV cache of kv_dtype (the generation's, so an int8 cache scores what it decoded)."""
    B, T = tokens.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype,
                       kv_dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    out = forward(params, config, tokens, pos, cache, logit_positions=positions)
    return token_logprobs(out.logits, targets, sampling, k)


def _row_stream(stream: Stream, owners: list[tuple[int, int]], holds: list, offset: int) -> Stream:
    """The runner's stream(row in batch, text) as the user's stream(prompt index, text), stop strings held back."""
    def on_text(i: int, piece: str) -> None:
        r = offset + i
        if holds[r] is not None:
            piece = holds[r].push(piece)
        if piece:
            stream(owners[r][0], piece)
    return on_text


def _gather(prompts: list, ids: list[list[int]], owners: list[tuple[int, int]],
            comps: list[CompletionOutput]) -> list[RequestOutput]:
    """One RequestOutput per prompt from its samples' completions, in sample order."""
    per: list[list[CompletionOutput]] = [[] for _ in prompts]
    for (i, _), c in zip(owners, comps):
        per[i].append(c)
    return [RequestOutput(prompts[i], list(ids[i]), cs, requests.merge_metrics([c.metrics for c in cs]),
                          request_id=str(i)) for i, cs in enumerate(per)]


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
