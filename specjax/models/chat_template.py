"""Chat templates from model files, rendered in jinja2's sandbox with limits on time, work and memory.

A chat template is code shipped inside a model file (tokenizer_config.json, chat_template.jinja, GGUF metadata),
so it is run like untrusted code. jinja2's `ImmutableSandboxedEnvironment` already refuses attribute escapes
(`''.__class__.__mro__`, `lipsum.__globals__`) and mutation; it does not bound resources: nested
`range(100000)` loops run for hours, `lipsum(n=10**7)` and `'x' * 10**9` allocate gigabytes,
`tojson(indent=10**9)` exhausts memory. Here every rendering runs under a `_Budget`:

- steps: each loop iteration over `range`, call, attribute or item lookup, operator and output counts one; past
  `TemplateLimits.steps`, or past `seconds` of wall-clock time (checked as steps are counted), rendering stops;
- characters: any string or list the template is about to build is sized first (`'x' * n`, `~` concatenation,
  `+`, `%` formatting, `str.replace/join/center/...`, `center/indent/wordwrap/join/replace/format/tojson` filters,
  and every piece of output, static text included); one value over `output_chars`, or all of them together over
  `produced_chars`, stops rendering before the allocation;
- arguments: `range` longer than `range_len`, integer arguments to filters and string methods over `int_arg`,
  `lipsum` beyond 100 paragraphs of 1,000 words, `tojson` indents or separators over 16 characters are refused.
Each stop is a `ChatTemplateError` (a `TokenizerError`) that says which limit was hit.

Budgets live in a context variable, so one compiled template can render in several threads at once.
"""
from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
import re
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2 import lexer, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

from specjax.errors import TokenizerError

__all__ = ["ChatTemplateError", "TEMPLATE_LIMITS", "TemplateLimits", "compile_template", "render"]


class ChatTemplateError(TokenizerError):
    """A chat template could not be compiled or rendered, or ran past one of its limits."""


class _Stop(BaseException):
    """A limit hit inside a rendering. A BaseException, so that no `except Exception` / `except ValueError` in
    jinja2's filters or in the template's own calls can swallow it; `render` turns it into a ChatTemplateError."""


def _big(n: int) -> str:
    """An integer for a message, without converting a huge one to decimal (which Python refuses past 4300 digits)."""
    return str(n) if abs(n) < 10**12 else f"about 2^{abs(n).bit_length() - 1}"


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one rendering. The defaults leave real templates (a few hundred steps per message, prompts of
    a model's whole context) far inside them and stop hostile ones within seconds and a few hundred MB."""

    source_chars: int = 1_000_000  # length of the template's own text
    output_chars: int = 4_000_000  # the rendered prompt, and any single string or list built on the way
    produced_chars: int = 32_000_000  # everything built along the way, all together
    steps: int = 2_000_000  # loop iterations, calls, lookups, operators, outputs
    seconds: float = 5.0  # wall-clock time of one rendering
    range_len: int = 100_000  # longest range()
    int_arg: int = 1_000_000  # largest integer argument of a filter or string method (widths, counts)


TEMPLATE_LIMITS = TemplateLimits()
_JSON_PAD = 16  # longest tojson indent / separator

_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("specjax_template_budget", default=None)


class _Budget:
    """Work and memory spent by one rendering so far."""

    __slots__ = ("limits", "steps", "produced", "deadline")

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.steps = 0
        self.produced = 0
        self.deadline = time.monotonic() + limits.seconds

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.steps:
            raise _Stop(f"the chat template ran more than {self.limits.steps} steps (loop iterations, "
                                    "calls, lookups); it loops too long or endlessly")
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise _Stop(f"the chat template ran longer than {self.limits.seconds:g} s; it loops too long "
                                    "or endlessly")

    def produce(self, n: int, what: str = "a string") -> None:
        """Account for `n` characters (or list items) about to be built; raise before building too many."""
        if n > self.limits.output_chars:
            raise _Stop(f"the chat template would build {what} of {_big(n)} characters; the limit is "
                                    f"{self.limits.output_chars}")
        self.produced += n
        if self.produced > self.limits.produced_chars:
            raise _Stop(f"the chat template built more than {self.limits.produced_chars} characters in "
                                    "all; it generates too much text")

    def int_arg(self, value: Any, what: str) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.limits.int_arg:
            raise _Stop(f"the chat template passes {what} an integer argument of {_big(value)}; the limit "
                                    f"is {self.limits.int_arg}")


def _budget() -> _Budget:
    b = _CURRENT.get()
    # A template rendered outside `render` still has its single operations sized, though nothing accumulates.
    return b if b is not None else _Budget(TEMPLATE_LIMITS)


def _text_size(value: Any, cap: int) -> int:
    """Characters `str(value)` would have, counted without building it; stops counting once past `cap`."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= cap:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, Namespace):
            total += 13
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        elif isinstance(v, _CountedRange):
            total += 2 * len(v)
        else:
            total += len(str(v))
    return total


def _size_of_result(value: Any) -> int:
    if isinstance(value, (str, list, tuple, dict)):
        return len(value)
    return 0


# ------------------------------------------------------------------------------------------------ range
class _CountedRange:
    """`range` for templates: at most `range_len` items, and iterating it spends one step per item."""

    __slots__ = ("_r",)

    def __init__(self, r: range):
        self._r = r

    def __iter__(self):
        b = _budget()
        for i in self._r:
            b.tick()
            yield i

    def __reversed__(self):
        b = _budget()
        for i in reversed(self._r):
            b.tick()
            yield i

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, index):
        item = self._r[index]
        return _CountedRange(item) if isinstance(item, range) else item

    def __contains__(self, value) -> bool:
        return value in self._r

    def __eq__(self, other) -> bool:
        return isinstance(other, _CountedRange) and self._r == other._r

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._r)


def _limited_range(*args: Any) -> _CountedRange:
    b = _budget()
    b.tick()
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        raise _Stop(f"the chat template calls range() with non-integer arguments {args!r:.60}")
    r = range(*args)
    if len(r) > b.limits.range_len:
        raise _Stop(f"the chat template asks for range() of {len(r)} items; the limit is "
                                f"{b.limits.range_len}")
    return _CountedRange(r)


# ------------------------------------------------------------------------------------------------ globals
def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas in a prompt.
    b = _budget()
    b.tick()
    if indent is not None and not (
            (isinstance(indent, int) and not isinstance(indent, bool) and 0 <= indent <= _JSON_PAD)
            or (isinstance(indent, str) and len(indent) <= _JSON_PAD)):
        raise _Stop(f"the chat template calls tojson with indent={indent!r:.40}; use an indent of at most "
                                f"{_JSON_PAD}")
    if separators is not None and not (isinstance(separators, (list, tuple)) and len(separators) == 2
                                       and all(isinstance(s, str) and len(s) <= _JSON_PAD for s in separators)):
        raise _Stop(f"the chat template calls tojson with separators={separators!r:.40}; use two strings "
                                f"of at most {_JSON_PAD} characters")
    size = _text_size(value, b.limits.output_chars)
    b.produce(size, "a JSON string")
    out = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                     separators=tuple(separators) if separators else None, sort_keys=sort_keys)
    b.produce(len(out), "a JSON string")
    return out


def _strftime_now(fmt: str) -> str:
    b = _budget()
    b.tick()
    if not isinstance(fmt, str):
        raise _Stop("strftime_now takes a format string")
    b.produce(4 * len(fmt), "a date string")
    return datetime.datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    b = _budget()
    b.tick()
    for name, value, hi in (("n", n, 100), ("min", min, 1000), ("max", max, 1000)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
            raise _Stop(f"the chat template calls lipsum with {name}={value!r:.40}; the limit is {hi}")
    b.produce(n * max * 16, "lorem ipsum text")
    return generate_lorem_ipsum(n, html, min, max)


# ------------------------------------------------------------------------------------------------ size checks
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*(\{|\})")


def _check_percent(b: _Budget, fmt: str, args: Any) -> None:
    """`fmt % args`: refuse widths and precisions over int_arg, written out or passed as '*'."""
    star = False
    for m in _PERCENT_SPEC.finditer(fmt):
        for g in m.groups():
            if g == "*":
                star = True
            elif g and (len(g) > 9 or int(g) > b.limits.int_arg):
                raise _Stop(f"the chat template formats with a width of {g[:12]}; the limit is "
                                        f"{b.limits.int_arg}")
    if star:
        for a in args if isinstance(args, tuple) else (args,):
            b.int_arg(a, "a '%*d' width")


def _check_format(b: _Budget, fmt: str, args: tuple, kwargs: dict) -> None:
    """`fmt.format(...)`: refuse widths over int_arg, written out or nested ('{:{}}')."""
    for field in re.findall(r"\{[^{}]*\}", fmt):
        for digits in re.findall(r"\d+", field):
            if len(digits) > 9 or int(digits) > b.limits.int_arg:
                raise _Stop(f"the chat template formats with a width of {digits[:12]}; the limit is "
                                        f"{b.limits.int_arg}")
    if _FORMAT_FIELD.search(fmt):
        for a in (*args, *kwargs.values()):
            b.int_arg(a, "str.format")


def _replace_size(s: str, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def _join_size(b: _Budget, sep: str, items: list) -> int:
    cap = b.limits.output_chars
    total = len(sep) * max(0, len(items) - 1)
    for item in items:
        total += _text_size(item, cap)
        if total > cap:
            break
    return total


def _check_str_method(b: _Budget, s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Size what a string method is about to build; returns the (possibly materialised) args."""
    for a in (*args, *kwargs.values()):
        b.int_arg(a, f"str.{name}")
    if name in ("center", "ljust", "rjust", "zfill") and args:
        width = args[0] if isinstance(args[0], int) else 0
        b.produce(max(len(s), width))
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        b.produce(len(s) + s.count("\t") * max(0, tab if isinstance(tab, int) else 0))
    elif name == "replace" and len(args) >= 2:
        b.produce(_replace_size(s, *args[:3]))
    elif name == "join" and args:
        items = list(args[0])
        b.produce(_join_size(b, s, items))
        args = (items, *args[1:])
    elif name in ("format", "format_map"):
        _check_format(b, s, args, kwargs if name == "format" else (args[0] if args and isinstance(args[0], dict)
                                                                   else {}))
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        b.produce(len(s) * max(1, longest))
    return args


def _check_binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                b.produce(len(seq) * max(0, n), "a repeated string or list")
                return
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 100_000:
            raise _Stop("the chat template multiplies integers of over 100,000 bits")
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            b.produce(len(left) + len(right), "a concatenated string or list")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and right * abs(left).bit_length() > 100_000:
            raise _Stop(f"the chat template raises to the power {_big(right)}; the result would exceed "
                                    "100,000 bits")
    elif op == "%" and isinstance(left, str):
        _check_percent(b, left, right)
        b.produce(len(left) + _text_size(right, b.limits.output_chars), "a formatted string")


# ------------------------------------------------------------------------------------------------ filters
def _limit_filter(name: str, fn: Any) -> Any:
    """Wrap a filter: a step per call, integer parameters capped, the result sized (before it is built for the
    filters that can multiply their input)."""
    shift = 1 if hasattr(fn, "jinja_pass_arg") else 0  # context / environment comes first

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        value, params = (args[shift] if len(args) > shift else None), args[shift + 1:]
        for p in (*params, *kwargs.values()):
            b.int_arg(p, f"the {name} filter")
        if name in ("string", "pprint", "join", "list", "format", "escape", "e", "forceescape", "urlencode",
                    "urlize"):
            if name == "join" and value is not None and not isinstance(value, (str, list, tuple)):
                value = list(value)
                args = (*args[:shift], value, *params)
            if name in ("join", "list", "string", "pprint"):
                b.produce(_text_size(value, b.limits.output_chars), f"the result of the {name} filter")
        if name == "center" and isinstance(value, str):
            width = params[0] if params else kwargs.get("width", 80)
            b.produce(max(len(value), width if isinstance(width, int) else 0))
        elif name == "indent" and isinstance(value, str):
            width = params[0] if params else kwargs.get("width", 4)
            pad = len(width) if isinstance(width, str) else (width if isinstance(width, int) else 0)
            b.produce(len(value) + (value.count("\n") + 1) * max(0, pad))
        elif name == "wordwrap" and isinstance(value, str):
            width = params[0] if params else kwargs.get("width", 79)
            wrap = params[2] if len(params) > 2 else kwargs.get("wrapstring") or "\n"
            per = max(1, width if isinstance(width, int) else 1)
            b.produce(len(value) + (len(value) // per + 1) * (len(wrap) if isinstance(wrap, str) else 1))
        elif name == "replace" and isinstance(value, str) and len(params) >= 2:
            b.produce(_replace_size(value, *params[:3]))
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = params[0] if params else kwargs.get("d", "")
            b.produce(_join_size(b, sep if isinstance(sep, str) else "", list(value)))
        elif name == "format" and isinstance(value, str):
            _check_percent(b, value, tuple(params) or tuple(kwargs.values()))
        elif name == "slice" and params and isinstance(params[0], int):
            b.tick(max(0, params[0]))
        result = fn(*args, **kwargs)
        b.produce(_size_of_result(result), f"the result of the {name} filter")
        return result

    return limited


# ------------------------------------------------------------------------------------------------ environment
class _StaticTextAsOutput(jinja2.ext.Extension):
    """Turn the template's literal text into `{{ '...' }}` expressions, so it goes through `finalize` and is
    counted like any other output (jinja2 otherwise emits it uncounted, even inside loops and macros)."""

    def filter_stream(self, stream):
        for token in stream:
            if token.type == lexer.TOKEN_DATA:
                yield lexer.Token(token.lineno, lexer.TOKEN_VARIABLE_BEGIN, "{{")
                yield lexer.Token(token.lineno, lexer.TOKEN_STRING, token.value)
                yield lexer.Token(token.lineno, lexer.TOKEN_VARIABLE_END, "}}")
            else:
                yield token


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the blocks with which Hugging Face templates mark the assistant's
    own tokens (for `return_assistant_tokens_mask`). Rendering a prompt needs no mask, so the body renders in
    place, exactly as if the tags were absent."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _CountingCodeGenerator(CodeGenerator):
    """Compiles `a ~ b ~ c` to a join that sizes its parts first (jinja2's own join cannot be intercepted)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.sized_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


@pass_context
def _finalize(context, value: Any) -> str:
    b = _budget()
    b.tick()
    size = _text_size(value, b.limits.output_chars)
    b.produce(size, "output")
    return value if isinstance(value, str) else str(value)


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every call, lookup, operator, concatenation and output going through `_Budget`."""

    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        b = _budget()
        b.tick()
        fn = getattr(__obj, "__wrapped__", __obj)  # str.format arrives wrapped by the sandbox
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(b, owner, getattr(fn, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        b.produce(_size_of_result(result), "the result of a call")
        return result

    def getattr(self, obj, attribute):
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        b = _budget()
        b.tick()
        _check_binop(b, operator, left, right)
        return super().call_binop(context, operator, left, right)

    def sized_concat(self, parts: tuple) -> str:
        b = _budget()
        b.tick()
        b.produce(sum(_text_size(p, b.limits.output_chars) for p in parts), "a concatenated string")
        return "".join(p if isinstance(p, str) else str(p) for p in parts)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                              extensions=[jinja2.ext.loopcontrols, _StaticTextAsOutput, _GenerationBlocks])
    env.filters = {name: _limit_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals.update(range=_limited_range, lipsum=_lipsum, raise_exception=_raise_exception,
                       strftime_now=_strftime_now)
    return env.from_string(source)


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def compile_template(source: str, origin: str = "the chat template",
                     limits: TemplateLimits = TEMPLATE_LIMITS) -> jinja2.Template:
    """Compile (once per distinct source) a template in the limited sandbox; ChatTemplateError naming `origin`
    if it is too long or does not compile."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"{origin}: a chat template must be a string, got {type(source).__name__}")
    if len(source) > limits.source_chars:
        raise ChatTemplateError(f"{origin}: the chat template is {len(source)} characters long; the limit is "
                                f"{limits.source_chars}")
    try:
        return _compile(source)
    except _Stop as stop:  # jinja2 folds constant filter calls at compile time, under the same checks
        raise ChatTemplateError(f"{origin}: {stop}") from None
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"{origin}: the chat template failed to compile: {_one_line(err)}") from None
    except RecursionError:
        raise ChatTemplateError(f"{origin}: the chat template is nested too deeply to compile") from None
    except (ValueError, TypeError, SyntaxError, MemoryError, OverflowError) as err:
        raise ChatTemplateError(f"{origin}: the chat template failed to compile ({type(err).__name__}: "
                                f"{_one_line(err)})") from None


def render(source: str, variables: dict, origin: str = "the chat template",
           limits: TemplateLimits = TEMPLATE_LIMITS) -> str:
    """Render `source` with `variables` under `limits`; any failure or limit is a ChatTemplateError naming
    `origin` and the problem."""
    template = compile_template(source, origin, limits)
    token = _CURRENT.set(_Budget(limits))
    try:
        out = template.render(**variables)
    except _Stop as stop:
        raise ChatTemplateError(f"{origin}: {stop}") from None
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"{origin}: the chat template failed: {_one_line(err)}") from None
    except RecursionError:
        raise ChatTemplateError(f"{origin}: the chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError(f"{origin}: the chat template ran out of memory") from None
    except Exception as err:  # a template can raise anything its filters and methods raise
        raise ChatTemplateError(f"{origin}: the chat template failed: {type(err).__name__}: {_one_line(err)}") \
            from None
    finally:
        _CURRENT.reset(token)
    if len(out) > limits.output_chars:
        raise ChatTemplateError(f"{origin}: the rendered chat is {len(out)} characters; the limit is "
                                f"{limits.output_chars}")
    return out
