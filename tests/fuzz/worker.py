"""Fork server that loads one fuzz input per child process, under a time and a memory limit.

Run as a script (`python tests/fuzz/worker.py`); it imports specjax's readers once, says {"ready": true} on
stdout, then answers one JSON request per stdin line: {"kind", "path", "timeout", "mem"} -> a JSON result line.
Each request is loaded in a fresh `fork()` child with RLIMIT_AS = its address space at fork + `mem` bytes and an
alarm as a backstop; the server kills it with SIGKILL at `timeout` seconds. Forking after the imports makes a
load cost milliseconds instead of the seconds a new interpreter would: the readers touch no JAX device (they
return NumPy arrays), so the child never needs the XLA runtime the parent has not started.

Result: {"status": "ok" | "specjax" | "raw" | "memory" | "signal" | "timeout" | "harness", "type", "message",
"where" (innermost frame of a raw exception), "seconds", "rss_kb" (the load's peak RSS above the child's RSS when
it started)}.
"""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time
import traceback

# The tiny target every corpus head and draft was built for (corpus.TARGET is this dict).
TARGET = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
              architecture="LlamaForCausalLM")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello ab 12 <|im_end|> é 🤖"}]


def _use_tokenizer(tok) -> None:
    """What a server does with a freshly loaded tokenizer: encode, decode, render a chat."""
    ids = tok.encode("Hello ab 12 <|im_end|> é 🤖")
    tok.decode(ids)
    if tok.chat_template is not None:
        tok.apply_chat_template(MESSAGES)


def _model(path: str) -> None:
    from specjax.models.loading import read_model

    _, _, tok, _ = read_model(path)
    _use_tokenizer(tok)


def _gguf_tokenizer(path: str) -> None:
    from specjax.models.tokenizer import Tokenizer

    _use_tokenizer(Tokenizer.from_gguf(path))


def _head(path: str) -> None:
    from specjax.heads.eagle_io import load_head
    from specjax.models.llama import LlamaConfig

    load_head(path, LlamaConfig(**TARGET))


def _medusa(path: str) -> None:
    from specjax.heads.medusa_io import read_medusa

    read_medusa(path, TARGET["hidden_size"], TARGET["vocab_size"])


def _draft(path: str) -> None:
    from specjax.models.draft_io import read_draft

    read_draft(path, TARGET["vocab_size"], TARGET["hidden_size"])


def _selftest(path: str) -> None:
    """Misbehaving loads, to show the server catches each (tests/fuzz/test_fuzz.py)."""
    how = os.path.basename(path)
    if how == "raw":
        raise KeyError("not a specjax error")
    if how == "hang":
        while True:
            pass
    if how == "memory":
        import numpy as np

        blocks = []  # untouched pages: only the address-space limit can stop this, and quickly
        while True:
            blocks.append(np.empty(64 << 20, np.uint8))
    if how == "crash":
        os.abort()


def _parts(path: str) -> None:
    from parts import load  # tests/fuzz/parts.py: this script's directory is sys.path[0]

    load(path)


TARGETS = {"model": _model, "gguf_tokenizer": _gguf_tokenizer, "head": _head, "medusa": _medusa, "draft": _draft,
           "parts": _parts, "selftest": _selftest}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _run_target(kind: str, path: str) -> dict:
    from specjax.errors import SpecjaxError

    try:
        TARGETS[kind](path)
        return {"status": "ok"}
    except SpecjaxError as e:
        return {"status": "specjax", "type": type(e).__name__, "message": str(e)}
    except MemoryError:
        return {"status": "memory", "type": "MemoryError", "message": ""}
    except BaseException as e:  # noqa: B036 - a Rust panic arrives as a BaseException; every one is a finding
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        return {"status": "raw", "type": type(e).__name__, "message": str(e)[:500], "where": where}


def _child(request: dict, write_fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    limit = _status_kb("VmSize") * 1024 + int(request["mem"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.alarm(int(request["timeout"]) + 10)
    try:  # reset the peak-RSS mark, so VmHWM below is this load's own peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base_kb = _status_kb("VmRSS")
    start = time.monotonic()
    result = _run_target(request["kind"], request["path"])
    result["seconds"] = round(time.monotonic() - start, 4)
    result["rss_kb"] = max(0, _status_kb("VmHWM") - base_kb)
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(write_fd, data):]


def run_one(request: dict) -> dict:
    """Load one input in a forked child and report how it ended."""
    base_kb = _status_kb("VmRSS")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            _child(request, write_fd)
        except BaseException:  # noqa: B036 - nothing may escape a forked child
            code = 70
        os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + float(request["timeout"])
    chunks, timed_out = [], False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if ready:
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status, usage = os.wait4(pid, 0)
    os.close(read_fd)
    rss_kb = max(0, usage.ru_maxrss - base_kb)  # for a child that died before reporting its own peak
    if timed_out:
        return {"status": "timeout", "type": "", "message": f"killed after {request['timeout']} s", "rss_kb": rss_kb}
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return {"status": "signal", "type": name, "message": f"child died of {name}", "rss_kb": rss_kb}
    try:
        result = json.loads(b"".join(chunks))
    except ValueError:
        return {"status": "harness", "type": "", "message": f"child exited {os.WEXITSTATUS(status)} without a result",
                "rss_kb": rss_kb}
    result.setdefault("rss_kb", rss_kb)
    return result


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import specjax.heads.eagle_io  # noqa: F401 - imported once here, shared by every forked child
    import specjax.heads.medusa_io  # noqa: F401
    import specjax.models.draft_io  # noqa: F401
    import specjax.models.loading  # noqa: F401
    import specjax.models.resolve  # noqa: F401
    import specjax.models.tokenizer  # noqa: F401

    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        out.write(json.dumps(run_one(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
