"""Tool calls read back out of a model's text, and tools written into a template that
takes none: exact shapes, no server."""

from __future__ import annotations

import json

from headroom.app.structured import ToolUse, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_hermes_calls_are_read_and_the_rest_is_content():
    use = ToolUse([WEATHER], forced=False, hermes=True)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</tool_call>'
    )
    calls, content = use.parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first_call():
    use = ToolUse([WEATHER], forced=False, hermes=True, parallel=False)
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</tool_call>'
    )
    calls, content = use.parse(text)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]


def test_text_that_only_looks_like_a_call_stays_text():
    use = ToolUse([WEATHER], forced=False, hermes=True)
    text = "<tool_call>{not json}</tool_call>"
    assert use.parse(text) == ([], text)
    assert ToolUse([WEATHER], forced=False, hermes=False).parse('<tool_call>{"name": "x"}</tool_call>') == (
        [],
        '<tool_call>{"name": "x"}</tool_call>',
    )


def test_a_forced_call_is_the_whole_text():
    calls, content = ToolUse([WEATHER], forced=True, hermes=False).parse(
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    )
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}


def test_a_template_without_tools_gets_them_and_past_calls_as_text():
    use = ToolUse([WEATHER], forced=True, hermes=False)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"t": 3}', "tool_call_id": "call_1"},
    ]
    out = template_messages(messages, use, template_takes_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call these functions:\n")
    assert json.dumps(WEATHER["function"]) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'}
    assert out[3] == {"role": "tool", "content": '{"t": 3}'}
    given = template_messages(messages, use, template_takes_tools=True)
    assert given[:2] == messages[:2] and given[3] == messages[3]
    assert given[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # a dict, as templates expect
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the caller's untouched
