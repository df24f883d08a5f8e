"""Request bodies of the public API, validated by pydantic. Known fields we do not
implement are refused rather than ignored; a top-level field no model declares is kept
aside (extra="allow") for app/fields.py to refuse or log, as [server] unknown_fields says."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from headroom.config import REQUEST_PRIORITY_BOUND
from headroom.contracts.repetition import MAX_PATTERN_SIZE, RepetitionDetection
from headroom.contracts.request import API_TEMPERATURE, LOGIT_BIAS, PENALTY, REPETITION_PENALTY, TOP_P

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice is a sequence of its own
# OpenAI fields not implemented: refused with a 400 naming them when set, never ignored
# (docs/OPENAI_API.md lists every field and what headroom does with it).
NOT_IMPLEMENTED = ("functions", "function_call", "best_of")
CHAT_NOT_IMPLEMENTED = (
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "moderation",
    "prompt_cache_options",
)


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required with type json_schema, and only with it")
        return self


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class RepetitionDetectionSpec(BaseModel):
    """vLLM's repetition_detection: max_pattern_size 0 (the default) turns it off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_pattern_size: Annotated[int, Field(ge=0, le=MAX_PATTERN_SIZE)] = 0
    min_pattern_size: Annotated[int, Field(ge=0)] = 0
    min_count: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _valid(self):
        if self.max_pattern_size:  # RepetitionDetection's ValueError becomes a 400 naming the field
            RepetitionDetection(self.max_pattern_size, self.min_pattern_size, self.min_count)
        return self

    @property
    def detection(self) -> RepetitionDetection | None:
        if self.max_pattern_size == 0:
            return None
        return RepetitionDetection(self.max_pattern_size, self.min_pattern_size, self.min_count)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: Annotated[float, Field(**API_TEMPERATURE.constraints())] = 1.0
    top_p: Annotated[float, Field(**TOP_P.constraints())] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # -1 or 0: off (vLLM's convention)
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None  # what a torch generator takes
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(**PENALTY.constraints())] = 0.0
    frequency_penalty: Annotated[float, Field(**PENALTY.constraints())] = 0.0
    # token id (as a string, as OpenAI sends it) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(**LOGIT_BIAS.constraints())]] | None = None
    response_format: ResponseFormatSpec | None = None
    # OpenAI fields not implemented: refused with a 400 naming them, never ignored.
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    # vLLM extensions
    repetition_penalty: Annotated[float, Field(**REPETITION_PENALTY.constraints())] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_detection: RepetitionDetectionSpec | None = None
    # vLLM's: lower is served earlier, within the tenant's tier (a tier always outranks it).
    priority: Annotated[int, Field(ge=-REQUEST_PRIORITY_BOUND, le=REQUEST_PRIORITY_BOUND)] = 0
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _supported(self):
        for name in NOT_IMPLEMENTED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        constrained = (
            self.guided_json is not None
            or self.guided_regex is not None
            or self.guided_choice is not None
            or (self.response_format is not None and self.response_format.type != "text")
        )
        for name in ("ignore_eos", "min_tokens"):
            if constrained and getattr(self, name):
                raise ValueError(f"{name}: not allowed with a structured output, which ends where its grammar does")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and not all(k.isascii() and k.isdigit() for k in v):
            raise ValueError("keys must be token ids (integers as strings)")
        return v

    @property
    def token_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), b) for k, b in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    tools: Any = None  # chat completions only
    tool_choice: Any = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _no_echo(self):
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported yet")
        for name in ("tools", "tool_choice"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: only in chat completions")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _tool_turns(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required for role 'tool'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        return self

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v, info: ValidationInfo):
        # Only an assistant turn (one that made tool calls) may come without content.
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"required for role {info.data['role']!r}")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # deprecated by OpenAI, still sent
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[ToolSpec], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted, with no effect here: bookkeeping of OpenAI's own platform.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    # Not implemented: refused when set.
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _only_what_is_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        for name in CHAT_NOT_IMPLEMENTED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported")
        if self.store:
            raise ValueError("store: completions are never stored here")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError('modalities: only ["text"] is supported')
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        return self

    @model_validator(mode="after")
    def _forced_tool_call_alone(self):
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            for name in ("response_format", "guided_json", "guided_regex", "guided_choice"):
                value = getattr(self, name)
                if value is not None and not (name == "response_format" and value.type == "text"):
                    raise ValueError(f"{name}: not with a forced tool call (tool_choice)")
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(f"{name}: not allowed with a forced tool call, which ends where its grammar does")
        return self
