"""Chat templates are code from model files: they run sandboxed and within limits of time, work and size.

Each hostile template is loaded the two ways a template reaches specjax, from a GGUF's `tokenizer.chat_template`
metadata and from an HF directory's tokenizer_config.json, and rendering it must stop quickly with a one-line
TokenizerError that names that file and the limit it hit. Before the limits, the probe of issue 29 saw nested
`range(100000)` loops and `lipsum(n=10**7)` hang, `'x' * 10**9` abort in the Rust tokenizer and
`tojson(indent=10**9)` run out of memory. Attribute escapes stay refused (rendered empty or an error, never run).
Real templates are unaffected: they render exactly as jinja2's own sandbox renders them, up to the size limit.
"""
from __future__ import annotations

import json
import time

import jinja2
import jinja2.ext
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fuzz.corpus import target_config, write_tiny_gguf
from helpers import write_byte_tokenizer
from specjax.models import chat_template
from specjax.models.chat_template import ChatTemplateError, TemplateLimits
from specjax.models.tokenizer import Tokenizer, TokenizerError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
SECONDS = 10  # generous: the defaults stop every attack below within about 2 s on an idle machine

ATTACKS = [
    ("nested-range", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops too long"),  # the step budget (2M steps) or, on a slow machine, the time limit (5 s)
    ("recursive-loop", "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursed too deeply"),
    ("recursive-macro", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    ("huge-range", "{% for i in range(10**9) %}{% endfor %}", "range() of 1000000000 items"),
    ("huge-range-list", "{{ range(10**9)|list }}", "range() of 1000000000 items"),
    ("lipsum", "{{ lipsum(n=10**7) }}", "lipsum with n=10000000"),
    ("tojson-indent", "{{ messages|tojson(indent=10**9) }}", "indent"),
    ("tojson-separators", "{{ messages|tojson(separators=(',' * 10**6, ':')) }}", "separators"),
    ("string-repeat", "{{ 'x' * 10**9 }}", "1000000000 characters"),
    ("list-repeat", "{{ (messages * 10**9)|length }}", "repeated string or list of 2000000000"),
    ("concat-doubling", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", "concatenated string"),
    ("plus-doubling", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s }}", "concatenated string"),
    ("percent-width", "{{ ('%0' ~ 10**9 ~ 'd') % 1 }}", "width"),
    ("format-width", "{{ '{:>1000000000}'.format(1) }}", "width"),
    ("format-filter-width", "{{ '%1000000000s'|format('x') }}", "width"),
    ("center", "{{ 'x'.center(10**9) }}", "integer argument"),
    ("center-filter", "{{ 'x'|center(10**9) }}", "integer argument"),
    ("indent-filter", "{{ ('a\\n' * 100000)|indent(100) }}", "characters"),
    ("replace", "{{ ('x' * 100000)|replace('x', 'y' * 1000) }}", "100000000 characters"),
    ("join", "{{ range(100000)|join('x' * 1000) }}", "characters"),
    ("power", "{{ 2 ** (10 ** 9) }}", "power"),
    ("strftime", "{{ strftime_now('%Y' * 10**6) }}", "characters"),
    ("output-size", "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "rendered chat is 10000000"),
    ("captured-output", "{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}{{ x }}",
     "built more than"),
    ("static-text-loop", "{% for i in range(100000) %}" + "static text, " * 100 + "{% endfor %}", "characters"),
    ("template-too-long", "x" * 1_000_001, "1000001 characters long"),
    ("deep-nesting", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),
]

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ strftime_now.__globals__['os'].system('touch MARKER') }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ (''|attr('__class__')).__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ range.__globals__['os'].system('touch MARKER') }}",
    "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages|length }}",  # mutation
]


def hf_source(tmp_path, template: str) -> tuple[str, str]:
    d = tmp_path / "hf"
    write_byte_tokenizer(d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return str(d), str(cfg_path)


def gguf_source(tmp_path, template: str) -> tuple[str, str]:
    cfg = target_config()
    rng = np.random.default_rng(0)
    from specjax.models.llama import param_shapes
    import jax

    params = jax.tree_util.tree_map(lambda s: rng.standard_normal(s).astype(np.float32), param_shapes(cfg),
                                    is_leaf=lambda s: isinstance(s, tuple))
    fn = str(tmp_path / "tpl.gguf")
    write_tiny_gguf(fn, cfg, params, template=template)
    return fn, fn


def load(source: str, tmp_path, template: str) -> tuple[Tokenizer, str]:
    """The tokenizer as specjax loads it from that source, and the file its template came from."""
    if source == "hf":
        d, origin = hf_source(tmp_path, template)
        return Tokenizer.from_hf_dir(d), origin
    fn, origin = gguf_source(tmp_path, template)
    return Tokenizer.from_gguf(fn), origin


def one_line(err, origin: str) -> str:
    msg = str(err)
    assert "\n" not in msg and origin in msg, msg
    return msg


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("name, template, needle", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_hostile_template_stops_with_a_clear_error(tmp_path, source, name, template, needle):
    tok, origin = load(source, tmp_path, template)
    start = time.monotonic()
    with pytest.raises(TokenizerError) as e:
        tok.apply_chat_template(MESSAGES)
    assert time.monotonic() - start < SECONDS, f"{name} took {time.monotonic() - start:.1f} s"
    assert isinstance(e.value, ChatTemplateError)
    assert needle in one_line(e.value, origin)


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("template", ESCAPES)
def test_attribute_escapes_stay_refused(tmp_path, source, template):
    marker = tmp_path / "escaped"
    tok, origin = load(source, tmp_path, template.replace("MARKER", str(marker)))
    try:
        out = tok.apply_chat_template(MESSAGES)
    except TokenizerError as e:
        msg = one_line(e, origin)
        assert "unsafe" in msg or "immutable" in msg or "not safely callable" in msg or "undefined" in msg, msg
    else:
        assert out in ("", "2"), out  # the forbidden attribute renders as nothing; messages keep 2 entries
    assert not marker.exists()


def test_the_time_limit_stops_a_loop_that_spends_few_steps(tmp_path):
    limits = TemplateLimits(seconds=0.5, steps=10**12)
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 0.5 s"):
        chat_template.render(template, {"messages": MESSAGES}, "test", limits)
    assert time.monotonic() - start < 5


def test_output_limit_boundary():
    limit = chat_template.TEMPLATE_LIMITS.output_chars
    assert len(chat_template.render(f"{{{{ 'x' * {limit} }}}}", {}, "t")) == limit
    with pytest.raises(ChatTemplateError, match=f"{limit + 1} characters"):
        chat_template.render(f"{{{{ 'x' * {limit + 1} }}}}", {}, "t")


# ------------------------------------------------------------------------------------------------ real templates
LLAMA3_LIKE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " ~ date_string|length ~ "\\n\\n" }}
{%- if tools is not none %}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

QWEN_LIKE = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- "# Tools\\n\\n<tools>" }}{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}{%- endfor %}{{- "\\n</tools><|im_end|>\\n" }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1]
.lstrip('\\n') + '<|im_end|>' + '\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

FEATURES = """{% macro row(m, i) -%}[{{ i }}:{{ m.role|upper }}] {{ m.content|replace('!', '.')|center(12) }}
{%- endmacro %}{% raw %}{{ not rendered }}{% endraw %}
{% for m in messages %}{{ row(m, loop.index) }}{% if not loop.last %}, {% endif %}{% endfor %}
{{ messages|map(attribute='role')|join('|') }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}
{% call(x) caller_test() %}{{ x }}{% endcall %}{% set c = cycler('a', 'b') %}{{ c.next() }}{{ c.next() }}
{{ '%5.1f|%-4s|' % (3.14159, 'ab') }}{{ '{:>6}'.format('r') }}{{ (1, 2) ~ 'x' ~ 3 }}{{ [1, 2] + [3] }}
{{ 'ab' * 3 }} {{ 2 ** 10 }} {{ 7 // 2 }} {{ messages[0].content[:4] }} {{ 'a b c'|wordcount }}
{{ {'b': 1, 'a': [1, {'c': None}]}|tojson(indent=2, sort_keys=true) }} {{ range(5)|reverse|list }}
{{ range(3)|batch(2)|list }} {{ range(6)|slice(2)|list }} {{ 'x y z'|wordwrap(3) }} {{ 'a\\nb'|indent(2, true) }}"""


def _plain_render(template: str, variables: dict) -> str:
    """jinja2's own immutable sandbox with the same helpers and settings, without specjax's limits."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(strftime_now=lambda fmt: "01 Jan 2025", raise_exception=None)
    return env.from_string(template).render(**variables)


@pytest.mark.parametrize("template", [LLAMA3_LIKE, QWEN_LIKE, FEATURES], ids=["llama3", "qwen", "features"])
def test_real_templates_render_as_jinja_renders_them(template, monkeypatch):
    monkeypatch.setattr(chat_template, "_strftime_now", lambda fmt: "01 Jan 2025")
    chat_template._compile.cache_clear()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "a <city> & country"}}}}}]
    caller = "{% macro caller_test() %}{{ caller(42) }}{% endmacro %}"
    for tools_value in (None, tools):
        variables = {"messages": [dict(m) for m in MESSAGES] * 3, "add_generation_prompt": True,
                     "bos_token": "<s>", "tools": tools_value}
        source = caller + template if template is FEATURES else template
        got = chat_template.render(source, dict(variables), "t")
        assert got == _plain_render(source, dict(variables))
        assert got.strip()
    chat_template._compile.cache_clear()


def test_long_real_conversation_renders_within_limits(tmp_path):
    """2,000 turns of 1,000 characters (2 MB of prompt) through a ChatML template: well inside every limit."""
    tok, _ = load("hf", tmp_path, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                                  "{% endif %}")
    msgs = [{"role": "user" if i % 2 else "assistant", "content": chr(97 + i % 26) * 1000} for i in range(2000)]
    start = time.monotonic()
    out = tok.apply_chat_template(msgs)
    assert time.monotonic() - start < SECONDS
    assert len(out) > 2_000_000 and out.endswith("<|im_start|>assistant\n")
