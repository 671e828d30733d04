"""The files of `specjax batch`: reading and checking the JSONL input, and the crash-safe result file.

Input lines become `Request`s (bad lines are reported and skipped); results are appended one line per
`write()` + fsync under an exclusive lock, and a torn last line left by a crash is cut off on open (see
`runners.batch` for the job itself).
"""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any, Callable

from specjax.config import ConfigError, SamplingParams, merge
from specjax.errors import SpecjaxError

_NOT_JSONL_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow", ".xlsx", ".xls", ".pkl", ".pickle")


class BatchError(SpecjaxError, ValueError):
    """The job cannot start: unreadable or non-JSONL input, unwritable output, unsupported method."""


@dataclasses.dataclass
class Request:
    """One valid input line."""

    id: str | int
    key: str  # json.dumps(id): 1 and "1" are different ids, as in the file
    line: int  # 1-based line number in the input
    prompt: Any  # text, token ids, or chat messages
    is_chat: bool  # prompt came from `messages`
    sampling: SamplingParams
    token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class JobSummary:
    """What a `run_job` call did. Token counts and timings cover this run only (not earlier, resumed runs)."""

    requests: int = 0  # valid requests in the input
    already_done: int = 0  # found in the output and skipped
    completed: int = 0  # finished and written by this run
    skipped_lines: int = 0  # bad input lines (reported on stderr)
    new_tokens: int = 0
    wall_time: float = 0.0  # seconds, compilation included
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    speculative: bool = False
    stopped: bool = False  # ended early on SIGTERM, after finishing the requests in flight
    failed: int = 0  # requests whose generation failed (reported, not written: a rerun tries them again)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length: 1 + accepted / verify steps (plain steps not counted)."""
        from specjax.requests import tau  # here, not at the top: this module stays JAX-free for `specjax --help`

        return tau(self.accepted, self.verify_steps)

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per decoding target forward, verify and plain steps alike, prefill excluded."""
        from specjax.requests import tokens_per_forward

        return tokens_per_forward(self.accepted, self.verify_steps + self.plain_steps)

    def format(self) -> str:
        parts = [f"{self.completed} requests done ({self.already_done} already in the output, "
                 f"{self.skipped_lines} bad input lines skipped)",
                 f"{self.new_tokens} tokens in {self.wall_time:.1f} s = {self.tokens_per_s:.1f} tok/s"]
        if self.speculative:
            parts.append(f"acceptance {self.acceptance_rate:.3f}, tau {self.tau:.2f} ({self.verify_steps} verify "
                         f"steps), {self.tokens_per_forward:.2f} tokens per target forward")
        if self.failed:
            parts.append(f"{self.failed} requests failed and were not written; rerun the same command to retry them")
        if self.stopped:
            parts.append("stopped on SIGTERM after the requests in flight; rerun the same command to resume")
        return "; ".join(parts)


# ----------------------------------------------------------------------------------------------------- input


def check_input(path: str) -> None:
    """Raise BatchError unless `path` is a readable JSONL file: at least one line must be a JSON object, and the
    file must not be a JSON array, a CSV or another table format. Reads only up to the first object line."""
    if not os.path.exists(path):
        raise BatchError(f"input {path!r} does not exist")
    if os.path.isdir(path):
        raise BatchError(f"input {path!r} is a directory; give a .jsonl file")
    if path.lower().endswith(_NOT_JSONL_SUFFIXES):
        raise BatchError(f"input {path!r}: unsupported format {os.path.splitext(path)[1]!r}; write JSONL, one "
                         '{"id": ..., "prompt": ...} object per line')
    try:
        with open(path, "rb") as f:
            first = None
            for raw in f:
                text = raw.strip()
                if not text:
                    continue
                if first is None:
                    first = text
                    if text.startswith(b"["):
                        raise BatchError(f"input {path!r} is a JSON array; write JSONL instead: one object per line "
                                         "(e.g. jq -c '.[]' in.json > in.jsonl)")
                try:
                    if isinstance(json.loads(text), dict):
                        return
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass
    except OSError as e:
        raise BatchError(f"cannot read input {path!r}: {e.strerror}") from None
    if first is not None:
        raise BatchError(f"input {path!r} is not JSONL: no line is a JSON object; write one "
                         '{"id": ..., "prompt": ...} object per line')


def read_requests(path: str, defaults: SamplingParams, report: Callable[[int, str], None],
                  prepare: Callable[[Request], None] | None = None) -> tuple[list[Request], int]:
    """Parse the input JSONL into requests; every bad line is reported as report(line_number, message) and
    skipped, in line order. Returns (requests, number of bad lines).

    prepare(request): further per-request work (tokenization, context checks) that raises ValueError for a bad
    request; its message is reported like a parse error.

    A line without `seed` in its sampling gets a seed derived from the job's seed and its id, so repeated prompts
    under different ids sample independently and a resumed job draws exactly the same tokens.
    """
    with open(path, "rb") as f:
        data = f.read()
    requests: list[Request] = []
    seen: dict[str, int] = {}
    bad = 0
    # Split on b"\n" only: str.splitlines would also split inside JSON strings holding U+2028 and friends.
    for n, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        problem, req = _parse_line(raw, n, defaults, seen)
        if req is not None and prepare is not None:
            try:
                prepare(req)
            except ValueError as e:
                problem = f"{e}; skipped"
        if problem:
            report(n, problem)
            bad += 1
        else:
            requests.append(req)
    return requests, bad


def _parse_line(raw: bytes, n: int, defaults: SamplingParams, seen: dict[str, int]):
    """(problem, None) or (None, Request) for one non-blank input line."""
    from specjax.models.safe_files import loads_untrusted

    try:
        obj = loads_untrusted(raw.decode("utf-8"), "line", _LineError)
    except UnicodeDecodeError:
        return "not UTF-8 text; skipped", None
    except _LineError as e:
        return f"{str(e).removeprefix('line: ')}; skipped", None
    if not isinstance(obj, dict):
        return f"expected a JSON object, got a {type(obj).__name__}; skipped", None
    if "id" not in obj:
        return "missing 'id'; every line needs a unique string or integer id; skipped", None
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return f"'id' must be a string or an integer, got {json.dumps(rid)}; skipped", None
    key = json.dumps(rid)
    if key in seen:
        return f"duplicate id {key} (first used on line {seen[key]}); skipped", None
    seen[key] = n
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return ("needs exactly one of 'prompt' (text) and 'messages' (chat list)" +
                ("; it has both" if has_prompt else "") + "; skipped"), None
    prompt = obj["prompt"] if has_prompt else obj["messages"]
    if has_prompt and not (isinstance(prompt, str) and prompt or _is_token_list(prompt)):
        return "'prompt' must be non-empty text or a list of token ids; skipped", None
    if has_messages and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects; skipped", None
    user = obj.get("sampling")
    if user is None:
        user = {}
    if not isinstance(user, dict):
        return f"'sampling' must be an object of sampling fields, got a {type(user).__name__}; skipped", None
    try:
        sp = merge(defaults, user)
    except ConfigError as e:
        return f"{e.under('sampling')}; skipped", None
    if "seed" not in user:
        sp = dataclasses.replace(sp, seed=zlib.crc32(f"{defaults.seed}:{key}".encode()) & 0x7FFFFFFF)
    return None, Request(rid, key, n, prompt, has_messages, sp)


class _LineError(ValueError):
    """An input line that cannot be read as JSON (`_parse_line` turns it into a skip)."""


def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


# ----------------------------------------------------------------------------------------------------- output


class ResultFile:
    """The output JSONL, opened for appending under an exclusive lock, with a torn last line repaired.

    `done` holds the keys (json.dumps(id)) of the results already in the file.
    """

    def __init__(self, path: str, note: Callable[[str], None] = lambda msg: None):
        self.path = path
        try:
            import fcntl  # POSIX only: imported here so that the rest of specjax imports on Windows
        except ImportError:
            raise BatchError("the batch result file needs POSIX file locks (fcntl), which this platform lacks; run "
                             "`specjax batch` on Linux, macOS or WSL") from None
        self.fd = open_output(path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise BatchError(f"output {path!r} is being written by another running job; wait for it or pick "
                             "another output file") from None
        try:
            self.done = self._repair(note)
        except BaseException:
            self.close()
            raise

    def _repair(self, note) -> set[str]:
        size = os.fstat(self.fd).st_size
        data = os.pread(self.fd, size, 0) if size else b""
        keep = data.rfind(b"\n") + 1  # bytes of newline-terminated lines
        lines = data[:keep].split(b"\n")[:-1]
        done: set[str] = set()
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            obj = _result_object(line)
            if obj is None:
                if n == len(lines):  # a torn final write that happened to end in a newline byte
                    keep -= len(line) + 1
                    break
                raise BatchError(f"output {self.path!r} line {n} is not a result line of specjax batch; remove it "
                                 "or choose another output file")
            done.add(json.dumps(obj["id"]))
        if keep < size:
            os.ftruncate(self.fd, keep)
            os.fsync(self.fd)
            note(f"output {self.path!r}: removed an incomplete last line ({size - keep} bytes) left by an "
                 "interrupted run")
        return done

    def write(self, record: dict) -> None:
        """Append one result as one line: a single write() (looped only if the OS writes less), then fsync. A
        failed write (a full disk, a file-size limit) is cut back to the last whole line and raised as a
        BatchError: the results before it stay, and a rerun resumes."""
        data = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        view = memoryview(data)
        start = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass  # the torn line is cut off on the next start (`_repair`)
            raise BatchError(f"cannot write the result of id {json.dumps(record['id'])} to {self.path!r}: "
                             f"{e.strerror or e}; the {len(self.done)} results before it are safe, free space (or "
                             "raise the limit) and rerun the same command to resume") from None
        self.done.add(json.dumps(record["id"]))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also releases the lock
            self.fd = -1


def _result_object(line: bytes) -> dict | None:
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) and "id" in obj else None


def open_output(path: str) -> int:
    """An O_APPEND file descriptor for `path` (created if missing); BatchError when it cannot be written."""
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except FileNotFoundError:
        raise BatchError(f"cannot write output {path!r}: directory "
                         f"{os.path.dirname(os.path.abspath(path))!r} does not exist; create it first") from None
    except IsADirectoryError:
        raise BatchError(f"output {path!r} is a directory; give a file path such as {path.rstrip('/')}/out.jsonl"
                         ) from None
    except PermissionError:
        raise BatchError(f"cannot write output {path!r}: permission denied; pick a writable location") from None
    except OSError as e:
        raise BatchError(f"cannot write output {path!r}: {e.strerror}") from None


def check_paths(input_path: str, output_path: str) -> None:
    """Everything about the two files that can fail before any work: input readable JSONL, output writable
    (created empty if missing) and not the input itself."""
    check_input(input_path)
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise BatchError(f"output {output_path!r} is the input file; write results to another file")
    os.close(open_output(output_path))
