"""Request bodies of the public API, validated by pydantic. Unknown fields are ignored,
as OpenAI does; known fields we do not implement are refused rather than ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_STOP_STRINGS = 16
NOT_IMPLEMENTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "best_of")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # -1 or 0: off (vLLM's convention)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    # token id (as a string, as OpenAI sends it) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    # OpenAI fields not implemented yet: refused with a 400 naming them, never ignored.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    # vLLM extensions
    repetition_penalty: Annotated[float, Field(gt=0, le=2, allow_inf_nan=False)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    priority: int = 0

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        for name in NOT_IMPLEMENTED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
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
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    name: str | None = None

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

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self
