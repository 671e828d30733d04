"""The OpenAI-compatible request bodies (pydantic models) and their translation into engine requests.

Every model forbids unknown fields (a misspelt option is a 400 naming it, never silently ignored). OpenAI's fields
are accepted where the server honours them; the ones it cannot honour yet (n > 1, logprobs, echo, best_of,
suffix, logit_bias, tools) are refused with a message saying so. vLLM's extensions: top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output, chat_template_kwargs,
add_generation_prompt; min_p, min_tokens and the penalties run inside the device loop.

Types are strict (pydantic strict mode): a string or a bool where a number belongs is a 400 naming the field,
never coerced (`"8"`, `true` and `"yes"` are refused), and NaN / infinity are refused. Numbers are bounded:
temperature in [0, 2] and top_p in (0, 1] (OpenAI's ranges), the penalties in [-2, 2], token counts and ids
below 2**31, and `seed` in [0, 2**32): the sampler draws from a 32-bit seed, so a larger seed is refused
rather than silently reduced (2**32 would sample exactly as 0 does).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specjax.config import SamplingParams
from specjax.requests import RequestError


MAX_SEED = 2**32 - 1  # the sampler's seeds are uint32 (`requests.sampling_arrays`)
_INT31 = 2**31 - 1

Count = Annotated[int, Field(ge=0, le=_INT31)]
TokenId = Annotated[int, Field(ge=0, le=_INT31)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """The sampling fields both endpoints share (OpenAI's names, vLLM's extensions)."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, le=_INT31)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=_INT31)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=1e6)
    min_tokens: Optional[Count] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    def _refuse(self, name: str, value: Any, why: str) -> None:
        raise RequestError(f"{name}={value!r} is not supported by this server: {why}")

    def sampling_params(self, max_tokens: Optional[int], default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (OpenAI's defaults: temperature 1, top_p 1). Raises RequestError /
        ConfigError (ValueErrors naming the field) for values out of range."""
        if self.logit_bias:
            self._refuse("logit_bias", self.logit_bias, "leave it unset")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true")
        kw: dict[str, Any] = dict(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=() if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop)),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, n=self.n, seed=self.seed)
        for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if kw.get("top_k") == -1:  # vLLM's "off"
            kw["top_k"] = 0
        return SamplingParams(**kw)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]]
    max_tokens: Optional[int] = Field(16, ge=1, le=_INT31)
    echo: bool = False
    logprobs: Optional[Count] = None
    best_of: Optional[Count] = None
    suffix: Optional[str] = None

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt of the request (a string or token ids)."""
        if self.echo:
            self._refuse("echo", self.echo, "the prompt is not repeated; leave echo false")
        if self.logprobs is not None:
            self._refuse("logprobs", self.logprobs, "log-probabilities are not served yet; leave logprobs unset")
        if self.best_of not in (None, 1):
            self._refuse("best_of", self.best_of, "send several requests instead")
        if self.suffix is not None:
            self._refuse("suffix", self.suffix, "insertion is not supported; leave suffix unset")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(f"prompt: {len(p)} prompts in one request; this server takes one prompt per "
                                   "request, send one request each")
            p = p[0]
        if not p:
            raise RequestError("prompt is empty; send some text or token ids")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def as_dict(self) -> dict:
        """{'role', 'content'} for the chat template (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=_INT31)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=_INT31)
    logprobs: bool = False
    top_logprobs: Optional[Count] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def requested_max_tokens(self) -> Optional[int]:
        if self.logprobs or self.top_logprobs:
            self._refuse("logprobs", self.logprobs, "log-probabilities are not served yet; leave logprobs unset")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens}"
                               " disagree; give one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str, code: int, param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
