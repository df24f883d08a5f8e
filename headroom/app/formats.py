"""Response and chunk shapes of /v1/completions and /v1/chat/completions (OpenAI's,
as vLLM emits them). One class per endpoint; the handler loop is shared."""

from __future__ import annotations

from dataclasses import dataclass, field

from headroom.app.structured import ToolUse
from headroom.executor.sampler import TokenLogprob


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
    # Text offsets of completions' logprobs, per choice; advanced as chunks are formatted.
    text_offsets: dict[int, int] = field(default_factory=dict, init=False)
    tools: ToolUse | None = None  # chat: the request may get tool calls back
    report_metrics: bool = False  # a `metrics` object on the response or the stream's last chunk

    @property
    def holds_text(self) -> bool:
        """Stream nothing until the end: the text may turn out to be tool calls."""
        return self.tools is not None

    object_full = ""
    object_chunk = ""

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[dict], usage: Usage) -> dict:
        return {**self._base(self.object_full), "choices": choices, "usage": usage.as_dict()}

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._base(self.object_chunk), "choices": [], "usage": usage.as_dict()}

    def chunk(self, choice: dict) -> dict:
        out = {**self._base(self.object_chunk), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


class CompletionFormat(ResponseFormat):
    object_full = object_chunk = "text_completion"

    def start_chunks(self, index: int = 0) -> list[dict]:
        return []

    def delta_chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        index: int = 0,
    ) -> dict:
        return self.chunk(
            {
                "index": index,
                "text": text,
                "logprobs": self._logprobs(text, logprobs, index),
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        )

    def choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
        index: int = 0,
    ) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(text, logprobs, index),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _logprobs(self, text: str, logprobs: list[TokenLogprob] | None, index: int) -> dict | None:
        offset = self.text_offsets.get(index, 0)
        if logprobs is None:
            self.text_offsets[index] = offset + len(text)
            return None
        tokens, offsets = [], []
        for lp in logprobs:
            piece = self.token_text(lp.token_id)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
        self.text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


class ChatFormat(ResponseFormat):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def start_chunks(self, index: int = 0) -> list[dict]:
        return [
            self.chunk(
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
        ]

    def delta_chunk(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        index: int = 0,
    ) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return self.chunk(
            {
                "index": index,
                "delta": delta,
                "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        )

    def choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
        index: int = 0,
    ) -> dict:
        message, finish_reason = self._message(text, finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def tool_chunks(
        self, text: str, finish_reason: str | None, stop_reason: str | int | None, index: int = 0
    ) -> list[dict]:
        """The held-back text of a stream, as OpenAI streams it: the content and each tool
        call (with its index) in one delta, then the finish."""
        message, finish_reason = self._message(text, finish_reason)
        delta: dict = {}
        if message["content"]:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks = (
            [self.chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})] if delta else []
        )
        chunks.append(
            self.chunk(
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            )
        )
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
        return {
            "content": [
                {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }
