"""Text <-> token ids for the models specjax serves, from a GGUF file or a Hugging Face directory.

The heavy lifting is done by the `tokenizers` library; this module only builds the right pipeline from
what a model file carries and adds the pieces generation needs around it: stop tokens, the chat
template, and a decoder that can be fed one token at a time.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary, the merges, the token types and the
name of the pre-tokenizer ("tokenizer.ggml.pre") as metadata. We rebuild the byte-level BPE from that
and pick the pre-tokenizer by name. An unknown name is refused rather than guessed, because a wrong
pre-tokenizer still produces plausible ids (it only differs around digits, newlines and whitespace
runs), which would silently change what the model sees.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from specjax.errors import SpecjaxError

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError"]


class TokenizerError(SpecjaxError, ValueError):
    """A tokenizer could not be built or used; the message names the problem and the fix."""


# llama.cpp token_type values (gguf.TokenType): 3 marks control tokens such as <|im_start|>, 4 marks
# user-defined added tokens such as <think>. Both must match whole in text instead of being cut by BPE.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Chat end-of-turn markers of the common templates (ChatML, Llama-3, Gemma). Generation must stop on
# them as well as on eos, since instruct models end a reply with the marker, not always with eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")

# Split patterns, as written in the tokenizer.json of the model families that use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer family, following llama.cpp's grouping of these names.
# "digits_gpt2": every number character alone, then the GPT-2 split (SmolLM, StarCoder).
_PRE_FAMILIES = {
    "smollm": "digits_gpt2",
    "starcoder": "digits_gpt2",
    "refact": "digits_gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "default": "gpt2",
    "olmo": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for one of the families of `_PRE_FAMILIES`."""
    if family == "digits_gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# ---------------------------------------------------------------------------------------------------
# GGUF metadata


def _gguf_value(reader: Any, key: str) -> Any:
    """One metadata value of a `gguf.GGUFReader`, as str / int / float / bool / list; None if absent.

    Reads `parts`/`data` directly instead of `ReaderField.contents()`, which older gguf releases lack.
    """
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i].tolist()[0] for i in field.data]
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]].tolist()[0]
    except UnicodeDecodeError as err:
        raise TokenizerError(f"GGUF metadata {key!r} is not valid UTF-8 ({err}); the file is damaged") from err


def _open_gguf(path_or_reader: Any) -> tuple[Any, str]:
    """A GGUFReader and a name for messages; accepts a path or an already open reader."""
    if hasattr(path_or_reader, "fields"):
        return path_or_reader, "the GGUF file"
    path = os.fspath(path_or_reader)
    if not os.path.isfile(path):
        raise TokenizerError(f"GGUF file not found: {path!r}; pass the path of a .gguf model file")
    from gguf import GGUFReader

    try:
        return GGUFReader(path), path
    except (ValueError, OSError) as err:
        raise TokenizerError(f"{path!r} is not a readable GGUF file ({err})") from err


# ---------------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas in a prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source (templates are pure text, so caching is safe)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"message {i} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        if not isinstance(message.get("role"), str):
            raise TokenizerError(f"message {i} has no string 'role'; each message needs 'role' and 'content'")
        if "content" not in message and "tool_calls" not in message:
            raise TokenizerError(f"message {i} (role {message['role']!r}) has no 'content'")
        checked.append(dict(message))
    return checked


# ---------------------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, stop ids and chat template. Immutable.

    Build it with `Tokenizer.from_gguf` or `Tokenizer.from_hf_dir`, not directly.
    """

    _backend: _Backend = field(repr=False)
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    unk_token_id: int | None
    stop_token_ids: tuple[int, ...]
    chat_template: str | None = field(repr=False)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Rebuild the tokenizer stored in a GGUF file's metadata (byte-level BPE, `tokenizer.ggml.model` gpt2).

        `path_or_reader` is a path or an open `gguf.GGUFReader` (so a model loader can parse the file once).
        """
        reader, name = _open_gguf(path_or_reader)
        model = _gguf_value(reader, "tokenizer.ggml.model")
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise TokenizerError(
                f"{name} has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens); "
                "load the tokenizer from the model's Hugging Face directory with Tokenizer.from_hf_dir"
            )
        if model != "gpt2":
            kind = "a sentencepiece" if model == "llama" else f"a {model!r}"
            raise TokenizerError(
                f"{name} holds {kind} tokenizer (tokenizer.ggml.model={model!r}); only byte-level BPE "
                "('gpt2') is supported from GGUF: use Tokenizer.from_hf_dir on the model's Hugging Face directory"
            )
        pre = _gguf_value(reader, "tokenizer.ggml.pre") or "default"
        family = _PRE_FAMILIES.get(pre)
        if family is None:
            raise TokenizerError(
                f"{name} uses pre-tokenizer {pre!r} (tokenizer.ggml.pre), which specjax does not know "
                f"(known: {sorted(_PRE_FAMILIES)}); use Tokenizer.from_hf_dir on the model's Hugging Face directory"
            )
        merges_raw = _gguf_value(reader, "tokenizer.ggml.merges")
        if not merges_raw:
            raise TokenizerError(f"{name} has a BPE vocabulary but no tokenizer.ggml.merges; the file is incomplete")
        merges = []
        for rank, merge in enumerate(merges_raw):
            pair = merge.split(" ")
            if len(pair) != 2:
                raise TokenizerError(f"{name}: merge {rank} {merge!r} is not two symbols separated by one space")
            merges.append((pair[0], pair[1]))

        # First occurrence wins on duplicate strings: BPE needs a one-to-one vocabulary, and the later
        # copy could never be produced by the merges anyway.
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
        # No unk token: bytes missing from the vocabulary are dropped, exactly as the HF tokenizer.json
        # of these models does (SmolLM2 lacks e.g. 0x04 and 0xF5..0xFF).
        backend = _Backend(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                       ignore_merges=family == "llama3")
        )
        backend.pre_tokenizer = _pre_tokenizer(family)
        backend.decoder = decoders.ByteLevel()

        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        special = [AddedToken(t, special=True, normalized=False)
                   for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user)

        def token_id(key: str) -> int | None:
            value = _gguf_value(reader, key)
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise TokenizerError(f"{name}: {key}={value} is outside the vocabulary of {len(tokens)} tokens")
            return int(value)

        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise TokenizerError(f"{name} has no tokenizer.ggml.eos_token_id; generation could never stop")
        add_bos = bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token"))
        add_eos = bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token"))
        if (add_bos and bos is not None) or add_eos:
            # Expressed as a post-processor so it also holds in a saved tokenizer.json.
            prefix = [tokens[bos]] if add_bos and bos is not None else []
            suffix = [tokens[eos]] if add_eos else []
            single = prefix + ["$A"] + suffix
            pair = single + prefix + ["$B:1"] + suffix
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join(single), pair=" ".join(pair),
                special_tokens=sorted({(tokens[i], i) for i in ([bos] if prefix else []) + ([eos] if suffix else [])}),
            )
        extra_stops = [token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")]
        return cls._assemble(
            backend,
            vocab_size=len(tokens),
            bos=bos,
            eos=eos,
            pad=token_id("tokenizer.ggml.padding_token_id"),
            unk=token_id("tokenizer.ggml.unknown_token_id"),
            extra_stops=[i for i in extra_stops if i is not None],
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json`, plus `tokenizer_config.json` (special tokens, chat template),
        `chat_template.jinja` and `generation_config.json` (extra eos ids) when present."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer directory not found: {path!r}; pass a Hugging Face model directory")
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise TokenizerError(
                f"no tokenizer.json in {path!r}; a sentencepiece-only tokenizer.model is not supported, convert it "
                "with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            backend = _Backend.from_file(tokenizer_json)
        except Exception as err:  # the Rust side raises plain Exception on malformed files
            raise TokenizerError(f"{tokenizer_json!r} could not be parsed by `tokenizers` ({err})") from err
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))

        # Added tokens listed only in the config still have to match whole in text.
        for index, entry in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            content = entry.get("content")
            if content and backend.token_to_id(content) is None:
                added = AddedToken(content, special=bool(entry.get("special")), normalized=False)
                (backend.add_special_tokens if entry.get("special") else backend.add_tokens)([added])

        def special_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, Mapping):  # serialized AddedToken
                value = value.get("content")
            if value is None:
                return None
            token = backend.token_to_id(value)
            if token is None:
                raise TokenizerError(f"{path!r}: {name} {value!r} of tokenizer_config.json is not in tokenizer.json")
            return token

        gen_eos = generation.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else [int(i) for i in gen_eos or []]
        eos = special_id("eos_token")
        if eos is None:
            eos = gen_eos[0] if gen_eos else None
        if eos is None:
            raise TokenizerError(
                f"{path!r} names no eos token (tokenizer_config.json 'eos_token' or generation_config.json "
                "'eos_token_id'); add one so generation can stop"
            )
        bos = special_id("bos_token")
        if bos is None and isinstance(generation.get("bos_token_id"), int):
            bos = generation["bos_token_id"]

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # newer transformers save it here, and it takes precedence there too
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls._assemble(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos=bos,
            eos=eos,
            pad=special_id("pad_token"),
            unk=special_id("unk_token"),
            extra_stops=gen_eos,
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def _assemble(cls, backend: _Backend, *, vocab_size: int, bos: int | None, eos: int, pad: int | None,
                  unk: int | None, extra_stops: Iterable[int], chat_template: str | None) -> Tokenizer:
        turn_ends = [backend.token_to_id(t) for t in _END_OF_TURN_TOKENS]
        stops = dict.fromkeys([eos, *extra_stops, *(t for t in turn_ends if t is not None)])
        return cls(
            _backend=backend,
            vocab_size=int(vocab_size),
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            unk_token_id=unk,
            stop_token_ids=tuple(int(t) for t in stops),
            chat_template=chat_template,
        )

    # -- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token markup in the text (e.g. '<|im_start|>') becomes its single id;
        `add_special_tokens` adds what the model's post-processor prescribes (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text (the Rust side runs them in parallel)."""
        texts = list(texts)
        for text in texts:
            if not isinstance(text, str):
                raise TokenizerError(f"encode_batch expects a list of str, got an item of type {type(text).__name__}")
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (byte-level spelling, e.g. 'Ġthe'), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of an id, or None."""
        return self._backend.id_to_token(int(token_id))

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text, e.g. to save a GGUF's tokenizer as a Hugging Face one."""
        return self._backend.to_str()

    # -- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render `messages` with the model's chat template (Jinja, sandboxed). Extra keyword `variables`
        (e.g. tools=...) are passed to the template as is."""
        if self.chat_template is None:
            raise TokenizerError(
                "this tokenizer has no chat template; pass a raw prompt, or a model whose tokenizer_config.json "
                "or GGUF metadata carries 'chat_template'"
            )
        checked = _check_messages(messages)
        context = {
            name: self.id_to_token(token)
            for name, token in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                                ("pad_token", self.pad_token_id), ("unk_token", self.unk_token_id))
            if token is not None
        }
        context.update(variables)
        try:
            template = _compile_template(self.chat_template)
            return template.render(messages=checked, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as err:
            raise TokenizerError(f"the chat template failed: {err}") from err


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path!r} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path!r} should hold a JSON object")
    return data


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces, for printing while generating.

    A character can span several tokens (an emoji is 4 UTF-8 bytes, often 2+ byte-level tokens), so
    text is released only once the bytes decoded so far form complete characters. Decoding a short
    window that starts a few tokens back, rather than each token alone, also keeps decoders whose
    output depends on context (leading-space handling in sentencepiece) correct.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of the text already returned

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still partial)."""
        self._ids.append(int(token_id))
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character shows as U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before):]
