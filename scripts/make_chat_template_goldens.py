#!/usr/bin/env python3
"""Writes tests/fixtures/chat_template/goldens.json: what transformers renders for a set of chat templates
and conversations (and for small Jinja snippets), which tests/chat_template_test.cpp must reproduce byte
for byte.

Templates: the shipped model's (models/default/tokenizer_config.json) and the two fixtures in
tests/fixtures/chat_template/ (Qwen3-style ChatML with JSON tool calls and enable_thinking; Qwen3.5-style
with XML tool calls, content parts and macros). Conversations: system prompts, multi-turn chat, tool
definitions, tool calls and tool results, reasoning content, thinking on/off, and errors the templates
raise. Snippets: single Jinja features rendered by transformers' own Jinja environment.

    python3 scripts/make_chat_template_goldens.py   (needs transformers: scripts/setup.sh --python)
"""
import json
import pathlib

import transformers
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "chat_template"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.  ",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web (returns JSON: \"title\", \"url\") — ünïcödé ✓",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def call(name, arguments, call_id="call_1", as_string=False):
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments) if as_string else arguments},
    }


CONVERSATIONS = [
    ("single_user", [{"role": "user", "content": "Hello!"}], None, {}),
    ("system_and_user", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None, {}),
    (
        "multi_turn",
        [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "    return x * 2"},
            {"role": "user", "content": "Now in one line, with \"quotes\" and 'apostrophes'\n\tand tabs."},
        ],
        None,
        {},
    ),
    ("unicode", [{"role": "user", "content": "Grüße 👋 — 日本語\nzweite Zeile"}], None, {}),
    ("thinking_off", [{"role": "user", "content": "2+2?"}], None, {"enable_thinking": False}),
    ("thinking_on", [{"role": "user", "content": "2+2?"}], None, {"enable_thinking": True}),
    (
        "reasoning_history",
        [
            {"role": "user", "content": "What is 3*3?"},
            {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\n9"},
            {"role": "user", "content": "And 4*4?"},
            {"role": "assistant", "content": "16", "reasoning_content": "Again multiply."},
        ],
        None,
        {},
    ),
    (
        "tools_defined",
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
        [WEATHER_TOOL, SEARCH_TOOL],
        {},
    ),
    ("tools_no_system", [{"role": "user", "content": "Find mtpx"}], [SEARCH_TOOL], {"enable_thinking": False}),
    (
        "tool_call_and_result",
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("get_weather", {"city": "Paris", "days": 2}),
                    call("get_weather", {"city": "Rome", "unit": "celsius"}, "call_2"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny, 25"},
        ],
        [WEATHER_TOOL],
        {},
    ),
    (
        "tool_call_with_text_then_answer",
        [
            {"role": "system", "content": "Be helpful."},
            {"role": "user", "content": "Search for llamas"},
            {
                "role": "assistant",
                "content": "Let me look that up.",
                "tool_calls": [call("search", {"query": "llamas", "limit": 3, "score": 0.5, "exact": True, "x": None})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Llamas are camelids."},
            {"role": "assistant", "content": "Llamas are camelids."},
            {"role": "user", "content": "Thanks"},
        ],
        [SEARCH_TOOL],
        {"enable_thinking": False},
    ),
    (
        "tool_call_string_arguments",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Oslo"}, as_string=True)]},
            {"role": "tool", "content": "cold"},
        ],
        [WEATHER_TOOL],
        {},
    ),
    (
        "content_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "You see images."}]},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "cat.png"},
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/dog.png"}},
                ],
            },
        ],
        None,
        {"show_image_count": True},
    ),
    ("developer_role", [{"role": "developer", "content": "Dev rules."}, {"role": "user", "content": "ok"}], None, {}),
    ("error_unknown_role", [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], None, {}),
    ("error_system_not_first", [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, {}),
]

# Which conversations each template is rendered with (the shipped template knows only role/content).
TEMPLATE_CASES = {
    "default": ["single_user", "system_and_user", "multi_turn", "unicode", "thinking_off", "developer_role"],
    "qwen3_style": [c[0] for c in CONVERSATIONS if c[0] not in ("content_parts", "developer_role", "error_system_not_first")],
    "qwen35_style": [c[0] for c in CONVERSATIONS if c[0] not in ("tool_call_string_arguments",)],
}

# Jinja features, each rendered by transformers' Jinja environment.
SNIPPETS = [
    ("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 ** 10 }}", {}),
    ("{{ 1.0 }}|{{ 0.1 + 0.2 }}|{{ 1e-5 }}|{{ 1e16 }}|{{ 123456789.0 }}|{{ 2.5e-3 }}|{{ 3 * 1.5 }}", {}),
    ("{{ none }}|{{ true }}|{{ false }}|{{ undefined_name }}|{{ [1, 'a', none, true] }}|{{ {'k': 'v', 'n': 1} }}", {}),
    ("{{ 'ab' ~ 1 ~ none }}|{{ 'x' * 3 }}|{{ [1] + [2] }}|{{ 'it\\'s' }}|{{ \"q\\\"d\" }}|{{ 'a' 'b' }}", {}),
    ("{{ xs | length }}|{{ 'héllo' | length }}|{{ xs | first }}|{{ xs | last }}|{{ xs | join('-') }}|{{ xs | reverse | list }}", {"xs": [3, 1, 2]}),
    ("{{ '  pad  ' | trim }}|{{ 'ab' | upper }}|{{ 'AB' | lower }}|{{ 'hello world' | title }}|{{ 'hELLO' | capitalize }}", {}),
    ("{{ x | default('d') }}|{{ '' | default('e', true) }}|{{ 0 | default('z') }}|{{ none | string }}|{{ 3 | string }}", {}),
    ("{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(sort_keys=true) }}|{{ 'é\"\\n' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}",
     {"d": {"b": [1, 2.5, None, True], "a": {"x": "y"}, "e": {}, "l": []}}),
    ("{% for k, v in d | items %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %}|{{ d.items() | list }}|{{ d.get('a') }}|{{ d.get('zz', 'no') }}|{{ d['b'] }}",
     {"d": {"a": 1, "b": 2}}),
    ("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.cycle('o', 'e') }} {% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% for x in xs if x > 1 %}{{ x }}{{ loop.index }}{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{% set a = 1 %}{% for x in [1] %}{% set a = 2 %}{{ a }}{% endfor %}{{ a }}{% if true %}{% set a = 3 %}{% endif %}{{ a }}", {}),
    ("{% set ns = namespace(n=0, s='') %}{% for x in range(5) %}{% set ns.n = ns.n + x %}{% set ns.s = ns.s ~ x %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("{{ s[1:3] }}|{{ s[::-1] }}|{{ s[-2:] }}|{{ xs[1:] }}|{{ xs[::2] }}|{{ xs[-1] }}|{{ s[0] }}|{{ xs[10] is defined }}", {"s": "abcdé", "xs": [1, 2, 3, 4]}),
    ("{{ s.split(',') }}|{{ s.split(',', 1) }}|{{ ' a  b '.split() }}|{{ s.rsplit(',', 1) }}|{{ s.startswith('a') }}|{{ s.endswith(('x', 'c')) }}|{{ s.replace(',', ';') }}|{{ s.find('b') }}|{{ s.count(',') }}",
     {"s": "a,b,c"}),
    ("{{ '\\n\\nx\\n'.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  l'.lstrip() }}|{{ 'r\\n\\n'.rstrip('\\n') }}|{{ '-'.join(['a', 'b']) }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}", {}),
    ("{{ 1 in [1, 2] }}|{{ 'b' in 'abc' }}|{{ 'k' in {'k': 1} }}|{{ 3 not in [1] }}|{{ 1 < 2 and 2 > 3 }}|{{ none or 'fallback' }}|{{ 0 and 1 }}|{{ not 0 }}", {}),
    ("{{ x is defined }}|{{ y is undefined }}|{{ x is none }}|{{ 's' is string }}|{{ 1 is number }}|{{ 1 is integer }}|{{ 1.5 is float }}|{{ {} is mapping }}|{{ [] is iterable }}|{{ 'a' is sequence }}|{{ 3 is odd }}|{{ 4 is even }}|{{ 9 is divisibleby 3 }}|{{ true is true }}|{{ false is false }}|{{ 1 is eq 1 }}|{{ x is not none }}",
     {"x": None}),
    ("{{ 'yes' if x else 'no' }}|{{ 'a' if false }}|{{ (1, 2) }}|{{ [1, 2][0] }}|{{ {'a': {'b': 'c'}}.a.b }}|{{ xs.0 }}", {"x": 1, "xs": [7]}),
    ("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }}|{{ greet('B', '?') }}|{{ greet(name='C', punct='.') }}", {}),
    ("{% set block %}inner {{ 1 + 1 }}{% endset %}[{{ block }}]|{% filter upper %}shout {{ 'it' }}{% endfilter %}", {}),
    ("{{ users | map(attribute='name') | join(',') }}|{{ users | selectattr('admin') | map(attribute='name') | list }}|{{ users | rejectattr('admin') | list | length }}|{{ [1, 0, 2] | select | list }}|{{ [1, 2, 3] | reject('odd') | list }}|{{ ['a', 'b', 'a'] | unique | list }}",
     {"users": [{"name": "ann", "admin": True}, {"name": "bob", "admin": False}]}),
    ("{{ '3' | int + 1 }}|{{ 'x' | int }}|{{ 2 | float }}|{{ -3 | abs }}|{{ 2.567 | round(2) }}|{{ 'a-b' | replace('-', '+') }}|{{ '<b>' | e }}|{{ 'l1\\nl2' | indent(2) }}", {}),
    ("a\n  {% if true %}\n    indented\n  {% endif %}\nb {# comment #}\n{%+ if true %}kept{% endif %}\n{{ 'x' }}\n  {{- 'y' -}}  \n z\n", {}),
    ("{%- for m in msgs -%}\n  <{{ m }}>\n{%- endfor %}\n\n{% if true -%}  \n  t  {%- endif %}", {"msgs": ["a", "b"]}),
    ("{{ raise_exception('bad ' ~ 1) }}", {}),
    ("{{ x.attr }}", {}),
    ("{{ 'a' + 1 }}", {}),
]


def main():
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "default")
    templates = {
        "default": tokenizer.chat_template,
        "qwen3_style": (FIXTURES / "qwen3_style.jinja").read_text(),
        "qwen35_style": (FIXTURES / "qwen35_style.jinja").read_text(),
    }
    by_name = {c[0]: c for c in CONVERSATIONS}
    cases = []
    for template_name, case_names in TEMPLATE_CASES.items():
        for case_name in case_names:
            _, messages, tools, kwargs = by_name[case_name]
            case = {"template": template_name, "name": case_name, "messages": messages, "tools": tools, "kwargs": kwargs}
            try:
                case["expected"] = tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=templates[template_name], tokenize=False,
                    add_generation_prompt=True, **kwargs)
            except Exception as e:  # noqa: BLE001 - the error itself is the golden
                case["error"] = str(e)
            cases.append(case)
    snippets = []
    for source, variables in SNIPPETS:
        snippet = {"source": source, "variables": variables}
        try:
            snippet["expected"] = _compile_jinja_template(source).render(**variables)
        except Exception as e:  # noqa: BLE001
            snippet["error"] = str(e)
        snippets.append(snippet)
    out = {
        "generator": "scripts/make_chat_template_goldens.py",
        "transformers": transformers.__version__,
        "special_tokens": tokenizer.special_tokens_map,
        "templates": {name: f"{name}.jinja" if name != "default" else "models/default/tokenizer_config.json"
                      for name in templates},
        "cases": cases,
        "snippets": snippets,
    }
    path = FIXTURES / "goldens.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    errors = sum("error" in c for c in cases)
    print(f"wrote {path}: {len(cases)} conversations ({errors} expected errors), {len(snippets)} snippets")


if __name__ == "__main__":
    main()
