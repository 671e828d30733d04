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

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from specjax.errors import TokenizerError
from specjax.models import chat_template
from specjax.models.gguf_file import GGUFFile, read_gguf
from specjax.models.safe_files import read_json_file

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError"]

# tokenizer.json is read by the Rust side in one piece; real ones are tens of MB at most.
MAX_TOKENIZER_JSON_BYTES = 512 << 20
MAX_TEMPLATE_FILE_BYTES = 4 << 20


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> re.Match | None:
    """The first lone surrogate in `text`, or None. JSON and Python strings allow them; UTF-8 and the Rust
    tokenizer do not (its message is internal), so text is checked before it reaches the tokenizer."""
    return _SURROGATE.search(text)


def _rust(what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call into `tokenizers`; its failures become a TokenizerError saying `what` failed. The Rust side raises
    plain Exception on bad input, and a Rust panic arrives as pyo3's PanicException, a BaseException."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError):
        raise
    except BaseException as err:  # noqa: B036 - see the docstring
        detail = " ".join(str(err).split())[:200]
        raise TokenizerError(f"{what} ({type(err).__name__}: {detail})") from None


# llama.cpp token_type values (gguf.TokenType): 3 marks control tokens such as <|im_start|>, 4 marks
# user-defined added tokens such as <think>. Both must match whole in text instead of being cut by BPE.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Chat end-of-turn markers of the common templates (ChatML, Llama-3, Gemma). Generation must stop on
# them as well as on eos, since instruct models end a reply with the marker, not always with eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
# End-of-document markers; from a GGUF they stop generation where the file names them as bos or padding.
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")

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
    """One metadata value of a `GGUFFile` (specjax's bounded reader) or a `gguf.GGUFReader`, as str / int /
    float / bool / list; None if absent.

    For a GGUFReader, reads `parts`/`data` directly instead of `ReaderField.contents()`, which older gguf
    releases lack.
    """
    if isinstance(reader, GGUFFile):
        return reader.get(key)
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
    """A GGUF reader and a name for messages; accepts a path, a `GGUFFile` or a `gguf.GGUFReader`. A path is
    read with specjax's bounded reader, metadata only (the tokenizer needs no tensor)."""
    if isinstance(path_or_reader, GGUFFile):
        return path_or_reader, path_or_reader.path
    if hasattr(path_or_reader, "fields"):
        return path_or_reader, "the GGUF file"
    path = os.fspath(path_or_reader)
    if not os.path.isfile(path):
        raise TokenizerError(f"GGUF file not found: {path!r}; pass the path of a .gguf model file")
    try:
        return read_gguf(path, error=TokenizerError, tensors=False), path
    except TokenizerError as err:
        detail = str(err)[len(path) + 2:] if str(err).startswith(f"{path}: ") else str(err)
        raise TokenizerError(f"{path!r} is not a readable GGUF file: {detail}") from None


def _typed(name: str, key: str, value: Any, kind: type | tuple, what: str) -> Any:
    """`value` of metadata/config `key` if it is of `kind` (bool never counts as int); else a TokenizerError."""
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise TokenizerError(f"{name}: {key} must be {what}, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def _str_list(name: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"{name}: {key} must be a list of strings")
    return value


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
    chat_template_origin: str | None = field(default=None, repr=False)  # the file (and key) it came from
    source: str | None = field(default=None, repr=False)  # the file or directory it was read from

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Rebuild the tokenizer stored in a GGUF file's metadata (byte-level BPE, `tokenizer.ggml.model` gpt2).

        `path_or_reader` is a path (read with specjax's bounded GGUF reader), a `GGUFFile` from
        `specjax.models.gguf_file.read_gguf` (so a model loader parses the file once) or a `gguf.GGUFReader`.
        Malformed metadata (wrong types, ids outside the vocabulary, merges of unknown tokens) -> TokenizerError.
        """
        reader, name = _open_gguf(path_or_reader)
        model = _gguf_value(reader, "tokenizer.ggml.model")
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise TokenizerError(
                f"{name} has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens); "
                "load the tokenizer from the model's Hugging Face directory with Tokenizer.from_hf_dir"
            )
        _typed(name, "tokenizer.ggml.model", model, str, "a string")
        tokens = _str_list(name, "tokenizer.ggml.tokens", tokens)
        if model != "gpt2":
            kind = "a sentencepiece" if model == "llama" else f"a {model[:40]!r}"
            raise TokenizerError(
                f"{name} holds {kind} tokenizer (tokenizer.ggml.model={model[:40]!r}); only byte-level BPE "
                "('gpt2') is supported from GGUF: use Tokenizer.from_hf_dir on the model's Hugging Face directory"
            )
        pre = _typed(name, "tokenizer.ggml.pre", _gguf_value(reader, "tokenizer.ggml.pre") or "default", str,
                     "a string")
        family = _PRE_FAMILIES.get(pre)
        if family is None:
            raise TokenizerError(
                f"{name} uses pre-tokenizer {pre[:40]!r} (tokenizer.ggml.pre), which specjax does not know "
                f"(known: {sorted(_PRE_FAMILIES)}); use Tokenizer.from_hf_dir on the model's Hugging Face directory"
            )
        merges_raw = _gguf_value(reader, "tokenizer.ggml.merges")
        if not merges_raw:
            raise TokenizerError(f"{name} has a BPE vocabulary but no tokenizer.ggml.merges; the file is incomplete")
        merges = []
        for rank, merge in enumerate(_str_list(name, "tokenizer.ggml.merges", merges_raw)):
            pair = merge.split(" ")
            if len(pair) != 2 or not pair[0] or not pair[1]:
                raise TokenizerError(f"{name}: merge {rank} {merge[:40]!r} is not two symbols separated by one space")
            merges.append((pair[0], pair[1]))

        # First occurrence wins on duplicate strings: BPE needs a one-to-one vocabulary, and the later
        # copy could never be produced by the merges anyway.
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
        # No unk token: bytes missing from the vocabulary are dropped, exactly as the HF tokenizer.json
        # of these models does (SmolLM2 lacks e.g. 0x04 and 0xF5..0xFF).
        bad = f"{name}: the tokenizer in the GGUF metadata is invalid; the file is corrupt"
        backend = _rust(bad, lambda: _Backend(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                       ignore_merges=family == "llama3")
        ))
        backend.pre_tokenizer = _pre_tokenizer(family)
        backend.decoder = decoders.ByteLevel()

        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if not isinstance(token_types, list) or len(token_types) != len(tokens) or not all(
                isinstance(k, int) and not isinstance(k, bool) for k in token_types):
            raise TokenizerError(f"{name}: tokenizer.ggml.token_type must be a list of {len(tokens)} integers, one per "
                                 "token")
        special = [AddedToken(t, special=True, normalized=False)
                   for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL and t]
        user = [AddedToken(t, special=False, normalized=False)
                for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED and t]
        _rust(bad, backend.add_special_tokens, special)
        _rust(bad, backend.add_tokens, user)

        def token_id(key: str) -> int | None:
            value = _gguf_value(reader, key)
            if value is None:
                return None
            _typed(name, key, value, int, "an integer token id")
            if not 0 <= value < len(tokens):
                raise TokenizerError(f"{name}: {key}={value} is outside the vocabulary of {len(tokens)} tokens")
            return value

        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise TokenizerError(f"{name} has no tokenizer.ggml.eos_token_id; generation could never stop")
        add_bos = _typed(name, "tokenizer.ggml.add_bos_token", _gguf_value(reader, "tokenizer.ggml.add_bos_token")
                         or False, bool, "true or false")
        add_eos = _typed(name, "tokenizer.ggml.add_eos_token", _gguf_value(reader, "tokenizer.ggml.add_eos_token")
                         or False, bool, "true or false")
        if (add_bos and bos is not None) or add_eos:
            # Expressed as a post-processor so it also holds in a saved tokenizer.json.
            prefix = [tokens[bos]] if add_bos and bos is not None else []
            suffix = [tokens[eos]] if add_eos else []
            single = prefix + ["$A"] + suffix
            pair = single + prefix + ["$B:1"] + suffix
            backend.post_processor = _rust(bad, processors.TemplateProcessing,
                single=" ".join(single), pair=" ".join(pair),
                special_tokens=sorted({(tokens[i], i) for i in ([bos] if prefix else []) + ([eos] if suffix else [])}),
            )
        extra_stops = [token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")]
        # A GGUF carries no generation_config.json, the file whose eos list holds the end-of-text token beside the
        # end-of-turn eos (Qwen2 / Qwen2.5 instruct: eos <|im_end|>, generation_config [<|im_end|>, <|endoftext|>]).
        # Such files name their end-of-text token as bos or padding; that token stops generation too. (SmolLM2
        # names <|endoftext|> only as unk, and Hugging Face does not stop on it there.)
        end_of_text = [i for i in (bos, token_id("tokenizer.ggml.padding_token_id"))
                       if i is not None and tokens[i] in _END_OF_TEXT_TOKENS]
        extra_stops += end_of_text
        template = _gguf_value(reader, "tokenizer.chat_template")
        if template is not None:
            _typed(name, "tokenizer.chat_template", template, str, "a string")
        return cls._assemble(
            backend,
            vocab_size=len(tokens),
            bos=bos,
            eos=eos,
            pad=token_id("tokenizer.ggml.padding_token_id"),
            unk=token_id("tokenizer.ggml.unknown_token_id"),
            extra_stops=[i for i in extra_stops if i is not None],
            chat_template=template,
            template_origin=f"{name} (tokenizer.chat_template)",
            source=name,
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
        size = os.path.getsize(tokenizer_json)
        if size > MAX_TOKENIZER_JSON_BYTES:
            raise TokenizerError(f"{tokenizer_json!r}: {size} bytes is too large for a tokenizer.json (limit "
                                 f"{MAX_TOKENIZER_JSON_BYTES}); the file is corrupt")
        backend = _rust(f"{tokenizer_json!r} could not be parsed by `tokenizers`", _Backend.from_file, tokenizer_json)
        # Truncation or padding set in the file would silently cut or pad every prompt.
        backend.no_truncation()
        backend.no_padding()
        config_path = os.path.join(path, "tokenizer_config.json")
        config = _read_json(config_path)
        gen_path = os.path.join(path, "generation_config.json")
        generation = _read_json(gen_path)

        # Added tokens listed only in the config still have to match whole in text.
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping) or not all(
                isinstance(k, str) and k.isdigit() and len(k) < 10 and isinstance(v, Mapping)
                for k, v in decoder.items()):
            raise TokenizerError(f"{config_path!r}: added_tokens_decoder must map token ids to token objects")
        bad = f"{config_path!r}: cannot add the tokens of added_tokens_decoder"
        for index, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = entry.get("content")
            if content is not None and not isinstance(content, str):
                raise TokenizerError(f"{config_path!r}: added token {index} has a non-string content")
            special = entry.get("special")
            if content and _rust(bad, backend.token_to_id, content) is None:
                added = AddedToken(content, special=bool(special), normalized=False)
                _rust(bad, backend.add_special_tokens if special else backend.add_tokens, [added])

        def special_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, Mapping):  # serialized AddedToken
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise TokenizerError(f"{config_path!r}: {name} must be a token string, got {type(value).__name__}")
            if lone_surrogate(value):
                raise TokenizerError(f"{config_path!r}: {name} {value[:40]!r} is not valid Unicode text (it holds a "
                                     "lone surrogate)")
            token = backend.token_to_id(value)
            if token is None:
                raise TokenizerError(f"{path!r}: {name} {value[:40]!r} of tokenizer_config.json is not in "
                                     "tokenizer.json")
            return token

        # The id space, not the count: a tokenizer.json whose ids have gaps (or one id far past the rest) must not
        # hand the model ids past what `vocab_size` promises (the load checks it against the embedding's rows).
        ids = _rust(f"{path!r}: cannot read the vocabulary", backend.get_vocab, with_added_tokens=True).values()
        vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

        def gen_id(key: str, value: Any) -> int:
            _typed(gen_path, key, value, int, "an integer token id")
            if not 0 <= value < vocab_size:
                raise TokenizerError(f"{gen_path!r}: {key} {value} is outside the tokenizer's vocabulary "
                                     f"[0, {vocab_size})")
            return value

        gen_eos = generation.get("eos_token_id")
        if gen_eos is not None and not isinstance(gen_eos, list):
            gen_eos = [gen_eos]
        gen_eos = [gen_id("eos_token_id", i) for i in gen_eos or []]
        eos = special_id("eos_token")
        if eos is None:
            eos = gen_eos[0] if gen_eos else None
        if eos is None:
            raise TokenizerError(
                f"{path!r} names no eos token (tokenizer_config.json 'eos_token' or generation_config.json "
                "'eos_token_id'); add one so generation can stop"
            )
        bos = special_id("bos_token")
        if bos is None and generation.get("bos_token_id") is not None:
            bos = gen_id("bos_token_id", generation["bos_token_id"])
        _apply_add_special_flags(backend, config, config_path, bos, eos)

        template = config.get("chat_template")
        origin = f"{config_path} (chat_template)"
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{config_path!r}: chat_template must be a string or a list of named templates, got "
                                 f"{type(template).__name__}")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # newer transformers save it here, and it takes precedence there too
            template, origin = _read_text(jinja_file, MAX_TEMPLATE_FILE_BYTES), jinja_file
        return cls._assemble(
            backend,
            vocab_size=vocab_size,
            bos=bos,
            eos=eos,
            pad=special_id("pad_token"),
            unk=special_id("unk_token"),
            extra_stops=gen_eos,
            chat_template=template,
            template_origin=origin,
            source=tokenizer_json,
        )

    @classmethod
    def _assemble(cls, backend: _Backend, *, vocab_size: int, bos: int | None, eos: int, pad: int | None,
                  unk: int | None, extra_stops: Iterable[int], chat_template: str | None,
                  template_origin: str | None = None, source: str | None = None) -> Tokenizer:
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
            chat_template_origin=template_origin,
            source=source,
        )

    # -- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token markup in the text (e.g. '<|im_start|>') becomes its single id;
        `add_special_tokens` adds what the model's post-processor prescribes (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return _rust(f"{self.source or 'the tokenizer'}: cannot encode this text", self._backend.encode, text,
                     add_special_tokens=add_special_tokens).ids

    def encode_text_only(self, text: str) -> list[int]:
        """Token ids of `text` with special-token markup read as ordinary characters: '<|im_start|>' typed by a
        user becomes the tokens of those characters, never the control token (no BOS added). For untrusted
        message content inside a chat template (`specjax.requests.encode_prompt`)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return _rust(f"{self.source or 'the tokenizer'}: cannot encode this text", self._plain_backend.encode, text,
                     add_special_tokens=False).ids

    @functools.cached_property
    def _plain_backend(self) -> _Backend:
        # A copy with encode_special_tokens set, so the shared backend's setting never changes under a caller.
        backend = _Backend.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt as the model expects them, as Hugging Face and vLLM build them: raw text gets the
        special tokens the post-processor prescribes (the BOS of Llama / Mistral base models, see `add_bos`);
        text rendered by a chat template (`chat`) gets none, since the template writes its own (a BOS it writes
        is not doubled, and one it leaves out is not added)."""
        return self.encode(text, add_special_tokens=not chat)

    @property
    def add_bos(self) -> bool:
        """Whether raw-text prompts get a BOS: the post-processor (tokenizer.json's, or the one that
        tokenizer_config.json's add_bos_token / a GGUF's tokenizer.ggml.add_bos_token set up) puts it first."""
        if self.bos_token_id is None:
            return False
        ids = _rust(f"{self.source or 'the tokenizer'}: cannot encode", self._backend.encode, "",
                    add_special_tokens=True).ids
        return ids[:1] == [self.bos_token_id]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text (the Rust side runs them in parallel)."""
        texts = list(texts)
        for text in texts:
            if not isinstance(text, str):
                raise TokenizerError(f"encode_batch expects a list of str, got an item of type {type(text).__name__}")
        encoded = _rust(f"{self.source or 'the tokenizer'}: cannot encode these texts", self._backend.encode_batch,
                        texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return _rust(f"{self.source or 'the tokenizer'}: cannot decode these ids", self._backend.decode, ids,
                     skip_special_tokens=skip_special_tokens)

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
        """Render `messages` with the model's chat template (Jinja, sandboxed, with the limits of
        `specjax.models.chat_template.TEMPLATE_LIMITS` on time, steps and size). Extra keyword `variables`
        (e.g. tools=...) are passed to the template as is. A failing template, or one past a limit, raises a
        TokenizerError (ChatTemplateError) naming the file the template came from."""
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
        context.update(messages=checked, add_generation_prompt=add_generation_prompt)
        return chat_template.render(self.chat_template, context, self.chat_template_origin or "the chat template")


def _apply_add_special_flags(backend: _Backend, config: Mapping, config_path: str, bos: int | None,
                             eos: int | None) -> None:
    """tokenizer_config.json's add_bos_token / add_eos_token, when either is given, decide what the post-processor
    adds around a single text (as transformers does: the flag that is absent counts as false, and a flag naming
    a token the tokenizer lacks adds nothing); when neither is given tokenizer.json's post-processor stays."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    flags = {key: _typed(config_path, key, config.get(key, False), bool, "true or false")
             for key in ("add_bos_token", "add_eos_token")}
    prefix = [(backend.id_to_token(bos), bos)] if flags["add_bos_token"] and bos is not None else []
    suffix = [(backend.id_to_token(eos), eos)] if flags["add_eos_token"] and eos is not None else []
    head, tail = [f"{t}:0" for t, _ in prefix], [f"{t}:0" for t, _ in suffix]
    single = head + ["$A:0"] + tail
    pair = single + [f"{t}:1" for t, _ in prefix] + ["$B:1"] + [f"{t}:1" for t, _ in suffix]
    backend.post_processor = _rust(f"{config_path!r}: cannot build the post-processor of add_bos_token / "
                                   "add_eos_token", processors.TemplateProcessing, single=" ".join(single),
                                   pair=" ".join(pair), special_tokens=sorted(set(prefix + suffix)))


def _read_json(path: str) -> dict:
    """A JSON object file of a tokenizer directory ({} if absent); malformed -> TokenizerError naming it."""
    if not os.path.isfile(path):
        return {}
    return read_json_file(path, TokenizerError)


def _read_text(path: str, max_bytes: int) -> str:
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise TokenizerError(f"{path!r}: {size} bytes is too large (limit {max_bytes})")
        with open(path, "rb") as f:
            return f.read(max_bytes + 1).decode("utf-8")
    except UnicodeDecodeError as err:
        raise TokenizerError(f"{path!r}: not UTF-8 text (byte {err.start}); the file is corrupt") from None
    except OSError as err:
        raise TokenizerError(f"{path!r}: cannot read ({err.strerror or err})") from None


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
