"""Response and chunk shapes of /v1/completions and /v1/chat/completions (OpenAI's,
as vLLM emits them). One class per endpoint; the handler loop is shared."""

from __future__ import annotations

from dataclasses import dataclass, field

from headroom.app.structured import ToolUse
from headroom.runtime.sampler import TokenLogprob


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ResponseFormat:
    id: str
    created: int
    model: str
    token_text: object  # callable: token id -> its text
    include_usage: bool = False
    # Text offsets for completions' logprobs; advanced as chunks are formatted.
    text_offset: int = field(default=0, init=False)
    tools: ToolUse | None = None  # chat: the request may get tool calls back

    @property
    def holds_text(self) -> bool:
        """Stream nothing until the end: the text may turn out to be tool calls."""
        return self.tools is not None

    object_full = ""
    object_chunk = ""

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._base(self.object_chunk), "choices": [], "usage": usage.as_dict()}

    def chunk(self, choice: dict) -> dict:
        out = {**self._base(self.object_chunk), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


class CompletionFormat(ResponseFormat):
    object_full = object_chunk = "text_completion"

    def start_chunks(self) -> list[dict]:
        return []

    def delta_chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                    stop_reason: str | int | None = None) -> dict:
        return self.chunk({"index": 0, "text": text, "logprobs": self._logprobs(text, logprobs),
                           "finish_reason": finish_reason, "stop_reason": stop_reason})

    def full(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
             stop_reason: str | int | None, usage: Usage) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(text, logprobs),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {**self._base(self.object_full), "choices": [choice], "usage": usage.as_dict()}

    def _logprobs(self, text: str, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            self.text_offset += len(text)
            return None
        tokens, offsets = [], []
        for lp in logprobs:
            piece = self.token_text(lp.token_id)
            tokens.append(piece)
            offsets.append(self.text_offset)
            self.text_offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


class ChatFormat(ResponseFormat):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def start_chunks(self) -> list[dict]:
        return [self.chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})]

    def delta_chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                    stop_reason: str | int | None = None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return self.chunk({"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs),
                           "finish_reason": finish_reason, "stop_reason": stop_reason})

    def full(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
             stop_reason: str | int | None, usage: Usage) -> dict:
        message, finish_reason = self._message(text, finish_reason)
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {**self._base(self.object_full), "choices": [choice], "usage": usage.as_dict()}

    def tool_chunks(self, text: str, finish_reason: str | None, stop_reason: str | int | None) -> list[dict]:
        """The held-back text of a stream, as OpenAI streams it: the content and each tool
        call (with its index) in one delta, then the finish."""
        message, finish_reason = self._message(text, finish_reason)
        delta: dict = {}
        if message["content"]:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks = [self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})] if delta else []
        chunks.append(self.chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason}))
        return chunks

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.tools is None or finish_reason != "stop":  # a call cut off by max_tokens stays text
            return {"role": "assistant", "content": text}, finish_reason
        calls, content = self.tools.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]}
