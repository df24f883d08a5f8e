"""The request body of /v1/responses (OpenAI's Responses API), validated by pydantic.
Text in and out, stateless: what it asks is what a chat request can ask, and responses.py
translates it into one. Known fields headroom does not implement are refused with a 400
naming them (docs/OPENAI_API.md lists them all); a top-level field the model does not
declare is kept aside for app/fields.py, as in schemas.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from headroom.contracts.request import API_TEMPERATURE, TOP_P

# Refused when set: no stored state (responses, conversations, prompt templates), no
# images, no server-side moderation, context management or background runs here.
NOT_IMPLEMENTED = (
    "previous_response_id",
    "conversation",
    "context_management",
    "prompt",
    "moderation",
    "image",
    "background_options",
    "prompt_cache_options",
)
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class InputPart(BaseModel):
    """A text part of a message: input_text, or output_text in an earlier assistant turn.
    Their other fields (annotations, logprobs, cache breakpoints) carry nothing for us."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["input_text", "output_text"]
    text: str


def _parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


# A string is shorthand for one text part. Validated as a list, so that an error names
# the part at fault rather than both arms of a union.
TextContent = Annotated[list[InputPart], BeforeValidator(_parts, json_schema_input_type=str | list[InputPart])]


class InputItem(BaseModel):
    """One item of `input`: a message, a function call the model made earlier, or the
    output of such a call. One flat model rather than a union, for the same reason."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: TextContent | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: TextContent | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        required = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
        }[self.type]
        for name in required:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: required in an item of type {self.type!r}")
        return self

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.output or []))


def _user_message(value: Any) -> Any:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class TextFormat(BaseModel):
    """`text.format`: OpenAI's response_format, flattened (name and schema at the top)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields_with_its_type(self):
        if self.type == "json_schema" and self.name is None:
            raise ValueError("name: required with type json_schema")
        if self.type != "json_schema" and (self.name or self.schema_ or self.description or self.strict) is not None:
            raise ValueError("name, schema, description and strict: only with type json_schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("not supported")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class ResponseStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = None  # accepted: no padding is ever added here


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Annotated[
        list[InputItem],
        BeforeValidator(_user_message, json_schema_input_type=str | list[InputItem]),
        Field(min_length=1),
    ]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(**API_TEMPERATURE.constraints())] | None = None
    top_p: Annotated[float, Field(**TOP_P.constraints())] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
        ]
        | None
    ) = None
    # Accepted, with no effect here: bookkeeping of OpenAI's own platform, or (max_tool_calls)
    # a cap on built-in tools, of which there are none here.
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    access_programs: dict[str, Any] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    # Accepted only as what headroom does anyway.
    store: bool | None = None  # nothing is stored
    background: bool | None = None  # every response runs while its request is open
    truncation: Literal["auto", "disabled"] | None = None  # too long an input is a 400
    include: list[str] | None = None  # nothing extra to include
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # no logprobs in the output
    reasoning: dict[str, Any] | None = None  # no reasoning models
    # Not implemented: refused when set.
    previous_response_id: Any = None
    conversation: Any = None
    context_management: Any = None
    prompt: Any = None
    moderation: Any = None
    image: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice_error(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:  # one message, not one per arm of the union
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...}') from None

    @model_validator(mode="after")
    def _supported(self):
        for name in NOT_IMPLEMENTED:
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}: not supported: nothing is stored here, and every request stands alone"
                    if name in ("previous_response_id", "conversation")
                    else f"{name}: not supported"
                )
        if self.store:
            raise ValueError("store: responses are never stored here; send false or leave it out")
        if self.background:
            raise ValueError("background: not supported; a response runs while its request is open")
        if self.truncation == "auto":
            raise ValueError('truncation: only "disabled" is supported (an input too long is a 400)')
        if self.include:
            raise ValueError("include: not supported")
        if self.top_logprobs:
            raise ValueError("top_logprobs: not supported")
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            raise ValueError("reasoning: not supported: no reasoning models here")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self
