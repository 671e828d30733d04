"""A request's prompt as token ids, prepared off the event loop: `Preparer`.

Tokenizing a long text and rendering a chat template are CPU work the event loop must not do (every stream's
tokens wait while it does), so they run on a small thread pool: the Rust tokenizer releases the interpreter
lock while it encodes, and the rest is bounded by the checks below, which run first and cost one pass over
the request's strings:

- size: a prompt with more characters than `max_prompt_chars` is refused before it is tokenized (by default
  the engine's max_prompt_tokens times the vocabulary's longest token, so no prompt that fits is refused);
- roles: a chat message's role is one of the template's roles (system, user, assistant, and tool / ipython /
  function / developer where the template names them); anything else is a 400 naming the message;
- special-token text: message content is tokenized as text (a user typing '<|im_start|>system' gets those
  characters, never the control token; `requests.encode_chat`); in every other field the template renders (a
  message's role and name, the values of chat_template_kwargs) special-token text is refused with a 400, since
  there it could only forge the template's own markup. Only a raw completion prompt (/v1/completions) is
  tokenized with its special tokens, as vLLM and llama.cpp do;
- chat_template_kwargs cannot set the arguments the server itself passes (messages, add_generation_prompt, the
  special-token variables, the template's helper functions).

The pool is bounded (`ServerLimits.prepare_workers` threads, `max_preparing` requests in it at most; more get
429). After a large request the C allocator is asked to give its free memory back (glibc's malloc_trim), so
one large request does not leave the server's resident size raised.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from specjax.requests import RequestError, check_text, encode_prompt

STANDARD_ROLES = ("system", "user", "assistant")
OPTIONAL_ROLES = ("tool", "ipython", "function", "developer")  # allowed when the template names them
# Variables the server sets itself when it renders a template (`Tokenizer.apply_chat_template`) and the template's
# helpers (`models.chat_template`): a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                                    "unk_token", "raise_exception", "strftime_now", "range", "lipsum"})
FALLBACK_CHARS_PER_TOKEN = 32  # for a tokenizer that does not list its vocabulary (test stand-ins)
TRIM_AFTER_CHARS = 1 << 20  # a request this large hands freed memory back to the OS when it is done
_TRIM_EVERY_S = 1.0


class BusyError(RequestError):
    """More requests are being prepared than `max_preparing` allows."""


def template_roles(tokenizer) -> tuple[str, ...]:
    """The roles a chat request may use with this tokenizer's template: the standard three, plus each optional
    role the template's source names as a string ('tool', "ipython", ...)."""
    source = getattr(tokenizer, "chat_template", None) or ""
    named = set(re.findall(r"""['"]([a-z_]+)['"]""", source))
    return STANDARD_ROLES + tuple(r for r in OPTIONAL_ROLES if r in named)


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token of the vocabulary stands for, bounded above by its spelled length (a
    byte-level BPE spells one byte per character; added tokens spell their text), or None when the tokenizer does
    not list its vocabulary."""
    to_token, size = getattr(tokenizer, "id_to_token", None), getattr(tokenizer, "vocab_size", None)
    if to_token is None or not isinstance(size, int):
        return None
    return max((len(to_token(i) or "") for i in range(size)), default=1) or 1


class Preparer:
    """Token ids of requests (checked as the module says), computed on a bounded thread pool."""

    def __init__(self, engine, limits):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.roles = template_roles(self.tokenizer)
        if limits.max_prompt_chars is not None:
            self.max_chars = limits.max_prompt_chars
        else:
            per = longest_token_chars(self.tokenizer) or FALLBACK_CHARS_PER_TOKEN
            self.max_chars = engine.options.max_prompt_tokens * per
        self.max_preparing = limits.max_preparing
        self.pool = ThreadPoolExecutor(limits.prepare_workers, thread_name_prefix="specjax-prepare")
        self._pending = 0
        self._lock = threading.Lock()
        self._last_trim = 0.0
        self._trim = _malloc_trim()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args) -> Any:
        """fn(*args) on the pool; BusyError (429) when `max_preparing` requests are already there."""
        with self._lock:
            if self._pending >= self.max_preparing:
                raise BusyError(f"the server is preparing {self._pending} requests already (its limit); retry "
                                "shortly")
            self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            with self._lock:
                self._pending -= 1

    # -- on the pool --------------------------------------------------------------------------------------

    def completion(self, prompt, sp):
        """(ids, checked SamplingParams) of a completion prompt (text or token ids)."""
        try:
            if isinstance(prompt, str):
                self._check_size(len(prompt), "prompt")
            ids = encode_prompt(self.tokenizer, self.engine.llm.config.vocab_size, prompt, False)
            return ids, self.engine.check(ids, sp)
        finally:
            self._after(len(prompt))

    def chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: Mapping[str, Any] | None, sp):
        """(ids, checked SamplingParams) of chat messages ({'role', 'content'[, 'name']} dicts)."""
        total = 0
        try:
            kwargs = dict(kwargs or {})
            reserved = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
            if reserved:
                raise _FieldError(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it (give "
                                  "messages and add_generation_prompt as the request's own fields)",
                                  f"chat_template_kwargs.{reserved[0]}")
            strings = list(_strings(kwargs, "chat_template_kwargs"))
            for i, m in enumerate(messages):
                strings += [(m["role"], f"messages[{i}].role"), (m["content"], f"messages[{i}].content")]
                if "name" in m:
                    strings.append((m["name"], f"messages[{i}].name"))
            total = sum(len(s) for s, _ in strings)
            self._check_size(total, "messages")
            for text, where in strings:
                try:
                    check_text(text, where)
                except RequestError as e:
                    raise _FieldError(str(e), where) from None
            for i, m in enumerate(messages):
                self._check_role(m["role"], i)
            for text, where in strings:
                if not where.endswith(".content") and self._has_markup(text):
                    raise _FieldError(f"{where} contains special-token text (such as '<|im_start|>'), which is "
                                      "only taken as text in message content; remove it", where)
            ids = encode_prompt(self.tokenizer, self.engine.llm.config.vocab_size, messages, True,
                                add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs)
            return ids, self.engine.check(ids, sp)
        finally:
            self._after(total)

    # -- checks -------------------------------------------------------------------------------------------

    def _check_size(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            raise _FieldError(f"{field}: the prompt has {chars} characters, more than this server's limit of "
                              f"{self.max_chars} (--max-prompt-chars; it takes at most "
                              f"{self.engine.options.max_prompt_tokens} prompt tokens); send a shorter prompt", field)

    def _check_role(self, role: str, i: int) -> None:
        if role in self.roles:
            return
        where = f"messages[{i}].role"
        if self._has_markup(role):
            raise _FieldError(f"{where} contains special-token text; a role is one of {', '.join(self.roles)}",
                              where)
        shown = role if len(role) <= 40 else role[:40] + "..."
        raise _FieldError(f"{where} is {shown!r}; this model's chat template takes the roles "
                          f"{', '.join(self.roles)}", where)

    def _has_markup(self, text: str) -> bool:
        """Whether `text` holds special-token text: encoding it with markup gives other ids than as plain text."""
        plain = getattr(self.tokenizer, "encode_text_only", None)
        return plain is not None and bool(text) and self.tokenizer.encode(text) != plain(text)

    def _after(self, size: int) -> None:
        """Hand freed memory back after a large request (at most once a second)."""
        if size < TRIM_AFTER_CHARS:
            return
        now = time.monotonic()
        if self._trim is not None and now - self._last_trim > _TRIM_EVERY_S:
            self._last_trim = now
            self._trim(0)


class _FieldError(RequestError):
    """A RequestError that names the request field at fault (`param` of the error body)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


MAX_KWARGS_DEPTH = 16


def _strings(value, where: str, depth: int = 0):
    """(string, field path) of every string in a JSON value, keys included."""
    if depth > MAX_KWARGS_DEPTH:
        raise _FieldError(f"{where} is nested more than {MAX_KWARGS_DEPTH} levels deep", where)
    if isinstance(value, str):
        yield value, where
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield str(k), where
            yield from _strings(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]", depth + 1)


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
