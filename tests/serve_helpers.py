"""What the server tests share: a tiny model behind a one-character-per-token tokenizer, and a server started on
127.0.0.1 at a free port in a thread (uvicorn, the same `make_server` as `specjax serve`)."""
from __future__ import annotations

import socket
import threading
import time

import jax
import jax.numpy as jnp

from specjax.api import LLM
from specjax.models.llama import LlamaConfig, init_params
from specjax.models.tokenizer import TokenizerError
from specjax.runners.runtime import SpecRuntime

EOS = 256


class CharTokenizer:
    """One printable character per token: ids 0..255 decode to chr(32 + id % 95), characters encode to
    ord(c) - 32; 256 is the end token. A chat template of '<r>content' per message then '<a>'."""

    stop_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(ord(c) - 32) % 95 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + int(t) % 95) for t in ids if int(t) < 256)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TokenizerError(f"message {i} needs string 'role' and 'content'")
        return "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + "<a>"


def tiny_llm(seed: int = 0, tokenizer=None, max_context: int = 512, vocab_size: int = 264) -> LLM:
    """A tiny random Llama (2 layers, hidden 32, vocabulary 264, or `vocab_size` to sit behind a real tokenizer)
    behind the LLM interface, no files; `tokenizer` defaults to `CharTokenizer`. Weights at scale 0.3 give peaked,
    prompt-dependent next-token distributions, so a wrong cache row or position changes the greedy tokens."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    llm = LLM.__new__(LLM)
    llm.model_spec, llm.dtype, llm.config, llm.source = "tiny", "float32", cfg, None
    llm.params = init_params(cfg, jax.random.PRNGKey(seed), jnp.float32, scale=0.3)
    llm.tokenizer = CharTokenizer() if tokenizer is None else tokenizer
    llm.max_context = max_context
    llm.backend, llm.attention_impl, llm.attention_fn, llm.runtime = "cpu", "reference", None, SpecRuntime()
    return llm


class RunningServer:
    """A uvicorn server for `app` in a thread, on 127.0.0.1 at a port the OS picked. url: its base URL."""

    def __init__(self, app, engine, shutdown_timeout: float = 10.0):
        from specjax.cli.serve import make_server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, engine, "127.0.0.1", self.port, shutdown_timeout, "warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head == key:
            return float(value)
    return 0.0
