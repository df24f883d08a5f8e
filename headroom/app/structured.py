"""Structured outputs and tool calls at the API edge: which grammar a request asks for
(response_format, vLLM's guided_* fields, a forced tool call), the tools put in front of
the model, and the model's tool calls read back out of its text in OpenAI's shape.

Tool calls the server forces (tool_choice "required" or a named function) are generated
under a grammar as one JSON object {"name": ..., "arguments": {...}}. With "auto", the
model decides; its calls are read where its chat template defines a format for them
(Hermes-style <tool_call>{...}</tool_call>, as Qwen2.5 and Hermes models emit). A template
that takes no tools at all (SmolLM2's) gets them described in the system message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from headroom.app.errors import BadRequest
from headroom.executor.grammar import GrammarSpec

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def grammar_spec(body) -> GrammarSpec | None:
    """The grammar `body` asks for: response_format or one guided_* field (not both)."""
    asked = [
        name
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
        if getattr(body, name, None) is not None
    ]
    fmt = body.response_format
    if fmt is not None and fmt.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise BadRequest(f"{asked[0]} and {asked[1]}: give at most one output constraint", param=asked[1])
    if not asked:
        return None
    if asked[0] == "response_format":
        if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
            return GrammarSpec("json")  # OpenAI allows a json_schema without a schema: any JSON
        return GrammarSpec.json_schema(fmt.json_schema.schema_)
    if asked[0] == "guided_json":
        return GrammarSpec.json_schema(_guided_json(body.guided_json))
    if asked[0] == "guided_regex":
        return GrammarSpec("regex", body.guided_regex)
    return GrammarSpec.choice(body.guided_choice)


def _guided_json(schema: dict | str) -> dict:
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"guided_json: not valid JSON: {exc}", param="guided_json") from None


def constraint_param(body) -> str:
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice"):
        if getattr(body, name, None) is not None:
            return name
    return "tool_choice"


@dataclass
class ToolUse:
    """What a chat request does with tools: `forced` calls are generated under a grammar;
    `hermes` reads <tool_call> blocks where the model may call."""

    tools: list[dict]
    forced: bool
    hermes: bool
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    def parse(self, text: str) -> tuple[list[dict], str | None]:
        """(tool_calls in OpenAI's shape, the content left over) from the model's text."""
        if self.forced:  # the grammar made it one object of this shape, unless a stop string cut it
            try:
                call = json.loads(text)
                return [_call(call["name"], call["arguments"])], None
            except (json.JSONDecodeError, KeyError, TypeError):
                return [], text
        if not self.hermes:
            return [], text
        calls = []
        for found in HERMES_CALL.finditer(text):
            try:
                call = json.loads(found.group(1))
                calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                return [], text  # not a call after all: leave the text as the model wrote it
        content = HERMES_CALL.sub("", text).strip() if calls else text
        return (calls if self.parallel else calls[:1]), content or None


def tool_use(body, template: str | None) -> tuple[ToolUse | None, GrammarSpec | None]:
    """The ToolUse of a chat request and the grammar a forced call needs (or None)."""
    if not body.tools or body.tool_choice == "none":
        return None, None
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools]
    names = [t.function.name for t in body.tools]
    choice = body.tool_choice or "auto"
    hermes = bool(template) and "<tool_call>" in template
    if choice == "auto":
        # Without a call format in the template, a call could not be told from an answer:
        # the model answers as with "none" (docs/OPENAI_API.md).
        parallel = body.parallel_tool_calls is not False
        return (ToolUse(tools, forced=False, hermes=True, parallel=parallel), None) if hermes else (None, None)
    if choice == "required":
        chosen = body.tools
    else:
        chosen = [t for t in body.tools if t.function.name == choice.function.name]
        if not chosen:
            raise BadRequest(
                f"tool_choice: no function named {choice.function.name!r} in tools ({', '.join(names)})",
                param="tool_choice",
            )
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return ToolUse(tools, forced=True, hermes=False), GrammarSpec.json_schema(schema)


def template_messages(messages: list[dict], use: ToolUse | None, template_takes_tools: bool) -> list[dict]:
    """Messages as the chat template gets them. A template that takes no tools gets them,
    and earlier tool calls, written out as text."""
    if template_takes_tools:  # such templates write the arguments out themselves (Qwen's with tojson)
        return [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            m = {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": m["content"]}
        else:
            m = {"role": m["role"], "content": m["content"] or ""}
        out.append(m)
    if use is not None:
        listing = "\n".join(json.dumps(t["function"]) for t in use.tools)
        note = (
            "You can call these functions:\n" + listing + "\nTo call one, answer with only a JSON object: "
            '{"name": <function name>, "arguments": <its arguments>}.'
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}
