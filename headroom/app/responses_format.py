"""The shapes of /v1/responses: the Response object and the events of its stream, made
from what the chat path produced (its text, finish reason and usage; its tool calls, read
back out of the text by ChatFormat as a chat completion's are)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from headroom.app.formats import ChatFormat, Usage

# A finish reason other than these is "stop": the response is complete.
STATUS = {"length": "incomplete", "repetition": "incomplete", "abort": "cancelled"}
# Why an incomplete response stopped: OpenAI's reason for a cap, headroom's for a loop.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "repetition": "repetition"}
FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}  # else response.failed


def usage_dict(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


@dataclass
class ResponsesFormat:
    chat: ChatFormat  # the id, model and creation time, and the tool calls in the text
    echo: dict  # the request's settings, which a Response carries back
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    incomplete_reason: str = "max_output_tokens"  # set by finished()

    @property
    def holds_text(self) -> bool:
        """Stream nothing until the end: the text may turn out to be function calls."""
        return self.chat.holds_text

    def response(
        self,
        status: str,
        output: list[dict],
        usage: Usage | None = None,
        error: dict | None = None,
        metrics: dict | None = None,
    ) -> dict:
        """metrics: the request's, on a final response where the server reports them."""
        incomplete = {"reason": self.incomplete_reason} if status == "incomplete" else None
        out = {
            "id": self.chat.id,
            "object": "response",
            "created_at": self.chat.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.chat.model,
            "output": output,
            "usage": usage_dict(usage) if usage is not None else None,
            **self.echo,
        }
        return out if metrics is None else {**out, "metrics": metrics}

    def message(self, text: str, status: str) -> dict:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else [],
        }

    def finished(self, text: str, finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, list[dict]]:
        """The status and output items of a response whose text is all there."""
        status = STATUS.get(finish_reason or "stop", "completed")
        self.incomplete_reason = INCOMPLETE_REASONS.get(finish_reason or "", "max_output_tokens")
        message = self.chat.choice(text, None, finish_reason, stop_reason)["message"]
        calls = message.get("tool_calls", [])
        items = (
            [self.message(message["content"] or "", "completed" if status == "completed" else "incomplete")]
            if message["content"] is not None or not calls
            else []
        )
        items += [
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            for call in calls
        ]
        return status, items


class ResponseEvents:
    """The events of one streamed response, in order and numbered. The message item is
    opened at the start unless the text is held (it may be function calls); then every
    item is opened, filled and closed at the end."""

    def __init__(self, fmt: ResponsesFormat):
        self.fmt = fmt
        self.sequence_number = 0

    def event(self, type_: str, **fields) -> dict:
        out = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def start(self) -> list[dict]:
        snapshot = self.fmt.response("in_progress", [])
        events = [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]
        return events if self.fmt.holds_text else events + self._open_message(0)

    def delta(self, text: str, output_index: int = 0) -> dict:
        return self.event(
            "response.output_text.delta",
            item_id=self.fmt.message_id,
            output_index=output_index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def finish(
        self,
        text: str,
        finish_reason: str | None,
        stop_reason: str | int | None,
        usage: Usage,
        metrics: dict | None = None,
    ) -> list[dict]:
        status, items = self.fmt.finished(text, finish_reason, stop_reason)
        events = []
        for index, item in enumerate(items):
            events += self._message(index, item) if item["type"] == "message" else self._function_call(index, item)
        final = self.fmt.response(status, items, usage, metrics=metrics)
        return events + [self.event(FINAL_EVENT.get(status, "response.failed"), response=final)]

    def failed(self, message: str) -> list[dict]:
        """An engine error after the stream began: the error, then the response, failed."""
        final = self.fmt.response("failed", [], error={"code": "server_error", "message": message})
        return [
            self.event("error", code="engine_error", message=message, param=None),
            self.event("response.failed", response=final),
        ]

    def _open_message(self, index: int) -> list[dict]:
        return [
            self.event("response.output_item.added", output_index=index, item=self.fmt.message("", "in_progress")),
            self.event(
                "response.content_part.added",
                item_id=self.fmt.message_id,
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def _message(self, index: int, item: dict) -> list[dict]:
        text = item["content"][0]["text"]
        events = []
        if self.fmt.holds_text:  # not opened yet: all of it now
            events += self._open_message(index) + ([self.delta(text, index)] if text else [])
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return events + [
            self.event("response.output_text.done", **ids, text=text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=text_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _function_call(self, index: int, item: dict) -> list[dict]:
        ids = {"item_id": item["id"], "output_index": index}
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
