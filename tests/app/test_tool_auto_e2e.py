"""tool_choice "auto" through the engine: the default model served with a Hermes-style chat
template (SmolLM2's own has no tool-call format), its generation steered into a
<tool_call>{...}</tool_call> block by a guided_regex that leaves the function, where there
is a choice, and its arguments to the model, and the server's parser turning the tokens
the engine generated into OpenAI tool_calls.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import openai
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig
from headroom.models.tokenizer import Tokenizer
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

CONFIG = Config(cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=4))
# Qwen2.5's format on SmolLM2's ChatML turns: tools listed in the system turn, calls as
# JSON inside <tool_call> tags.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "You can call functions. Their signatures are in <tools></tools>:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n</tools>\n"
    "To call one, write a JSON object with its name and arguments in <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}\n"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
# One call to either tool, the model's pick, with a value of its own.
CALL = (
    r'<tool_call>\n\{"name": "(get_weather", "arguments": \{"city"|get_time", "arguments": \{"tz"): '
    r'"[A-Za-z/_ ]{1,30}"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(default_model):
    hf = copy.deepcopy(default_model.tokenizer.hf)  # the session's model keeps its own template
    hf.chat_template = HERMES_TEMPLATE
    hermes = dataclasses.replace(default_model, tokenizer=Tokenizer(hf, default_model.tokenizer.eos_token_ids))
    assert hermes.tokenizer.template_takes_tools
    srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=hermes)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    c.model_name = server.engine.loaded.name
    return c


def ask(client, content: str, **kwargs):
    return client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": content}],
        tools=[WEATHER, TIME],
        tool_choice="auto",
        temperature=0,
        **kwargs,
    )


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_auto_turns_the_generated_call_into_tool_calls(client):
    res = ask(
        client, "What is the weather like in Oslo?", max_tokens=60, logprobs=True, extra_body={"guided_regex": CALL}
    )
    choice = res.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert calls_of(choice.message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    # The engine generated the block token by token, then its end of turn.
    tokens = [t.token for t in choice.logprobs.content]
    assert "".join(tokens[:-1]) == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert tokens[-1] == "<|im_end|>" and res.usage.completion_tokens == len(tokens)

    res = ask(client, "What time is it in Tokyo?", max_tokens=60, extra_body={"guided_regex": CALL})
    assert [name for name, _ in calls_of(res.choices[0].message.tool_calls)] == ["get_time"]


def test_text_before_the_call_is_the_content_when_streamed(client):
    chunks = list(
        ask(
            client,
            "Is it raining in Bergen right now?",
            max_tokens=60,
            stream=True,
            extra_body={"guided_regex": r"Let me check\.\n" + CALL},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.content for d in deltas if d.content] == ["Let me check."]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Bergen"})
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("parallel", [None, False])
def test_two_calls_and_parallel_tool_calls(client, parallel):
    extra = {"guided_regex": f"({CALL}\\n){{2}}"}
    if parallel is not None:
        extra["parallel_tool_calls"] = parallel
    res = ask(client, "What is the weather like in Oslo and in Bergen?", max_tokens=100, extra_body=extra)
    both = [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    assert res.choices[0].finish_reason == "tool_calls"
    assert calls_of(res.choices[0].message.tool_calls) == (both if parallel is None else both[:1])


def test_an_answer_without_a_call_stays_content(client):
    res = ask(client, "What is the weather like in Oslo?", max_tokens=40, stop=["."])
    choice = res.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content.startswith("The weather in Oslo is") and "<tool_call>" not in choice.message.content
