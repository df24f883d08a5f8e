"""The output side of the engine: from a request's submission to its last output, its
sink and its incremental detokenizer, and the text, stop strings and finish reason of
every RequestOutput it is sent. Runs on the engine thread, under the engine's state lock.

The counters arrive with each call rather than at construction: benchmarks replace
`Engine.stats` between runs, and what they read must be what was counted."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from headroom.contracts.request import Request, RequestStatus
from headroom.executor.sampler import Sampler, TokenLogprob
from headroom.runtime.detokenizer import IncrementalDetokenizer
from headroom.runtime.outputs import EngineStats, OutputSink, RequestOutput
from headroom.runtime.scheduler import Scheduler

RECENTLY_FINISHED = 10_000  # finished ids remembered, so a late action gets 409, not 404


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, sampler: Sampler) -> None:
        self.tokenizer = tokenizer  # the Hugging Face tokenizer the detokenizers decode with
        self.scheduler = scheduler  # a stop string finishes its request there
        self.sampler = sampler  # a closed request's generator is dropped there
        self.sinks: dict[str, OutputSink] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.finished: OrderedDict[str, str | None] = OrderedDict()  # request id -> finish reason

    def __contains__(self, request_id: str) -> bool:
        """Whether a live request has this id."""
        return request_id in self.sinks

    def add(self, request: Request, sink: OutputSink) -> None:
        self.sinks[request.request_id] = sink
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling.stop
        )

    def tokens(self, request: Request, count: int, logprobs: list[TokenLogprob | None], stats: EngineStats) -> None:
        """Send the request's `count` newest tokens (several where guesses were kept), and
        close it if one finished it. Each goes through the detokenizer alone, so a stop
        string ends the output at the token that completed it, as it would one at a time:
        the tokens after it are taken back."""
        rid = request.request_id
        new = request.output_token_ids[len(request.output_token_ids) - count :]
        text, sent = "", []
        for token in new:
            piece, stop_hit = self.detokenizers[rid].add_tokens([token])
            text += piece
            sent.append(token)
            if stop_hit is not None:
                self._stop_at(request, stop_hit, count - len(sent))
                break
        stats.generated_tokens += len(sent)
        kept = [lp for lp in logprobs[: len(sent)] if lp]
        output = RequestOutput(rid, sent, text, logprobs=kept or None, request=request)
        if request.is_finished:
            output.text += self.detokenizers[rid].finish()
            self._close(request, output, stats)
        else:
            self.sinks[rid](output)

    def _stop_at(self, request: Request, stop_hit: str, after: int) -> None:
        """A stop string ended the request, `after` tokens before its newest."""
        if after:
            del request.output_token_ids[-after:]
            del request.all_token_ids[-after:]
        if request.is_finished:
            # The same token also reached max_tokens (or a later one ended it); the text ends
            # at the stop string, so the stop string is what ended the request.
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.stop_reason = stop_hit

    def finish(self, request: Request, stats: EngineStats, error: str | None = None) -> None:
        """Close a request the scheduler has finished without a new token."""
        rid = request.request_id
        self._close(
            request, RequestOutput(rid, [], self.detokenizers[rid].finish(), error=error, request=request), stats
        )

    def close(self, request_id: str, status: RequestStatus, stats: EngineStats, error: str | None = None) -> None:
        """Finish a live request in the scheduler and send its last output."""
        request = self.scheduler.finish_request(request_id, status)
        if request is not None:
            self.finish(request, stats, error)

    def abort(self, request_id: str, cause: str, stats: EngineStats, error: str | None = None) -> None:
        """Abort a live request, counted by cause; an unknown or finished one is left be."""
        request = self.withdraw(request_id, cause, stats)
        if request is not None:
            self.finish(request, stats, error)

    def withdraw(self, request_id: str, cause: str, stats: EngineStats) -> Request | None:
        """Abort a live request in the scheduler, counted by cause, and leave its last
        output to the caller's `finish` (or to close_finished, should the caller crash)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        request.abort_cause = cause
        stats.aborts[cause] += 1
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def close_finished(self, requests: list[Request], stats: EngineStats) -> None:
        """After a crash past the scheduler's update, close the requests it had finished:
        they have left the scheduler, so the engine's crash handler, which fails what the
        scheduler holds, would leave their clients waiting."""
        for request in requests:
            if request.is_finished and request.request_id in self:
                if request.abort_cause is None:  # one withdrawn in the step is counted already
                    request.abort_cause = "engine_error"
                    stats.aborts["engine_error"] += 1
                self.finish(request, stats, "internal engine error")

    def reject(self, request: Request, sink: OutputSink, error: str) -> None:
        """Fail a request the engine never took: its one output is an error. The same
        object submitted again while it runs is the live request, and stays as it is."""
        if self.scheduler.requests.get(request.request_id) is not request:
            request.status = RequestStatus.FINISHED_ABORTED
            request.finished_time = time.monotonic()
        output = RequestOutput(request.request_id, [], "", error=error, request=request)
        output.finished, output.finish_reason = True, "error"
        sink(output)

    def _close(self, request: Request, output: RequestOutput, stats: EngineStats) -> None:
        rid = request.request_id
        output.finished = True
        output.finish_reason = "error" if output.error else request.status.finish_reason
        output.stop_reason = request.stop_reason
        stats.finished[output.finish_reason] += 1
        self.finished.pop(rid, None)  # a reused id is remembered from its latest finish
        self.finished[rid] = output.finish_reason
        if len(self.finished) > RECENTLY_FINISHED:
            self.finished.popitem(last=False)
        self.detokenizers.pop(rid)
        self.sampler.remove(rid)
        self.sinks.pop(rid)(output)
