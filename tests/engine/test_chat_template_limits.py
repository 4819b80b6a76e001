"""A chat template's rendering is bounded per row (issue #50, finding 8): a template that loops
for ever, prints for ever or builds a huge text fails its row with a one-line message naming the
limit, quickly, and the next row renders as before. Rendering matches transformers'
``apply_chat_template`` otherwise."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from batchgen_data.engine.chat_template import ChatTemplateLimits, render_chat_template
from batchgen_data.engine.tokenizer import ChatPrompt, PromptTokenizer
from batchgen_data.errors import ConfigError, RequestError

# Without the bounds these hang or fill the memory: fail them at this many seconds instead.
pytestmark = pytest.mark.timeout(60)

LIMITS = ChatTemplateLimits(time_limit_s=0.5, max_chars=100_000)
CONVERSATION = [{"role": "user", "content": "Is the parcel late?"}]
TIMED_OUT = "chat template rendering took longer than 0.5 s (the per-row limit)"
LOOPS = {
    "nested loops, nothing inside": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over one list": "{% set xs = range(100000)|list %}{% for i in xs %}{% for j in xs %}{% endfor %}{% endfor %}",
    "a loop that prints little": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "a macro that loops": "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                          "{% endmacro %}{{ m() }}",
    "recursive macro calls": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
}
# Sizes up to 2 GB: a regression fails these tests rather than the machine.
HUGE = {
    "string multiplication": ("{{ 'a' * 10 ** 9 }}", "would build a text of 1,000,000,000 characters"),
    "list multiplication": ("{{ ([1] * 10 ** 8)|length }}", "would build a list of 100,000,000 items"),
    "repeated multiplication": ("{{ 'a' * 1000 * 1000 }}", "would build a text of 1,000,000 characters"),
    "center": ("{{ 'a'.center(10 ** 9) }}", "would build a text of 1,000,000,000 characters"),
    "center filter": ("{{ 'a'|center(10 ** 9) }}", "would build a text of 1,000,000,000 characters"),
    "a constant filter call": ("{{ 'a'|center(2000000000) }}", "would build a text of 2,000,000,000 characters"),
    "join": ("{{ ('a' * 50000).join(range(1000)|map('string')) }}", "would build a text of 49,953,890 characters"),
    "printf width": ("{{ '%0999999999d' % 1 }}", "would build a text of 999,999,999 characters"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "would build a text of 999,999,999 characters"),
    "doubling in a namespace": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                "{% endfor %}{{ ns.s }}", "would build a text of 131,072 characters"),
    "doubling through a macro": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}"
                                 "{% endmacro %}{{ d('a', 60) }}", "would build a text of 131,072 characters"),
    "a huge power": ("{% set e = 10 ** 9 %}{{ 2 ** e }}", "would compute a 2,000,000,000-bit number"),
    "printing past the limit": ("{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}",
                                "produced more than 100,000 characters (the per-row limit)"),
    "a macro's output past the limit": ("{% macro m() %}{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}"
                                        "{% endmacro %}{{ m()|length }}", "more than 100,000 characters"),
}


@pytest.fixture(scope="module")
def hf(demo_path):
    return AutoTokenizer.from_pretrained(str(demo_path))


@pytest.fixture(scope="module")
def tokenizer(demo_path, hf):
    return PromptTokenizer(demo_path, len(hf), chat_template_limits=LIMITS)


@pytest.mark.parametrize("template", LOOPS.values(), ids=LOOPS.keys())
def test_a_template_that_loops_for_ever_fails_its_row_at_the_time_limit(tokenizer, template):
    start = time.monotonic()
    with pytest.raises(RequestError) as caught:
        tokenizer.encode(ChatPrompt(CONVERSATION, template))
    assert str(caught.value) == TIMED_OUT
    assert time.monotonic() - start < 3.0  # the limit, not the loop
    assert tokenizer.encode(CONVERSATION)  # the next row renders


@pytest.mark.parametrize(("template", "words"), HUGE.values(), ids=HUGE.keys())
def test_a_template_building_a_huge_text_fails_its_row_before_building_it(tokenizer, template, words):
    start = time.monotonic()
    with pytest.raises(RequestError, match="^chat template rendering ") as caught:
        tokenizer.encode(ChatPrompt(CONVERSATION, template))
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - start < 3.0


def test_the_default_limits_are_named_and_checked():
    assert ChatTemplateLimits() == ChatTemplateLimits(time_limit_s=5.0, max_chars=16_000_000)
    for bad in ({"time_limit_s": 0}, {"time_limit_s": float("nan")}, {"max_chars": 0}):
        with pytest.raises(ConfigError):
            ChatTemplateLimits(**bad)


def test_a_template_error_is_one_line_naming_it(tokenizer):
    with pytest.raises(RequestError) as caught:
        tokenizer.encode(ChatPrompt(CONVERSATION, "{{ raise_exception('no system role\nhere') }}"))
    assert str(caught.value) == "the chat template rejected the messages: no system role here"


def test_the_sandbox_still_refuses_unsafe_access(tokenizer):
    for template in ("{{ messages.__class__.__base__.__subclasses__() }}", "{% set ns = namespace() %}{% set ns._x = 1 %}",
                     "{{ messages.append(1) }}"):
        with pytest.raises(RequestError, match="the chat template rejected the messages"):
            tokenizer.encode(ChatPrompt(CONVERSATION, template))


# A template using what real chat templates use: tools, namespaces, reversed loops, macros,
# loop variables, tojson with options, the reasoning fields, {% generation %}, string methods,
# format, filters with tests, raise_exception and the special tokens.
RICH_TEMPLATE = """{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- macro render(m) -%}{{ m.content | trim }}{%- endmacro %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' ~ message.role) }}{% endif %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + render(message) + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}{%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + message.content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' }}{% generation %}{{ message.content }}{% endgeneration %}
        {%- endif %}
        {%- if message.tool_calls %}{%- for call in message.tool_calls %}{{ '\\n<tool_call>' }}{{ call | tojson(indent=2, sort_keys=true) }}{% if loop.last %}!{% endif %}{%- endfor %}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
{{- eos_token }}{{ "%05d|%s"|format(42, 'x') }}{{ "{:>4}".format(7) }}{{ [1, 2, 3]|join(',') }}{{ 'ab' * 3 }}
{{- dict.fromkeys(['a'])|tojson }}{{ (range(5)|list)[1:3] }}{{ 'x'.center(7) }}{{ 'a b'.replace(' ', '_') }}{{ 2 ** 10 }}
{%- for i in range(3) %}{% for j in range(2) if j %}{{ i }}{{ loop.length }}{% else %}e{% endfor %}{% endfor %}"""
CONVERSATIONS = [
    CONVERSATION,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "yo", "reasoning_content": "think", "tool_calls": None},
     {"role": "user", "content": " again "},
     {"role": "assistant", "content": "\nok", "thinking": "hmm", "tool_calls": [{"name": "f", "arguments": {"b": 1}}]},
     {"role": "tool", "content": "42"}],
    [{"role": "user", "content": "x", "name": None}],
]
KWARGS = [{}, {"enable_thinking": False}, {"tools": [{"name": "f", "description": "é"}]}]


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_rendering_matches_transformers_apply_chat_template(tokenizer, hf, conversation, kwargs):
    expected = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                      chat_template=RICH_TEMPLATE, **kwargs)["input_ids"]
    assert tokenizer.encode(ChatPrompt(conversation, RICH_TEMPLATE, kwargs)) == expected
    assert tokenizer.encode(conversation) == hf.apply_chat_template(conversation, add_generation_prompt=True,
                                                                    tokenize=True)["input_ids"]


def test_render_chat_template_without_a_tokenizer():
    assert render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", CONVERSATION, {}) == \
        "Is the parcel late?"
