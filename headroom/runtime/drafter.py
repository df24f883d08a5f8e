"""Speculative decoding with a draft model (vLLM's "draft_model" method): a second model with
the same tokenizer guesses a row's next k tokens by decoding them greedily, over a paged KV
cache of its own beside the target's.

Each row the speculator picks is first brought up to date in the draft's cache (the tokens
the target took since the draft last saw it: the prompt on its first guess, then the guesses
it kept and its own token), then decoded k - 1 more steps; each of these forwards carries
every row that guesses in the step. The draft's cache is trusted up to its first token the
target did not keep. Where the draft is the target's own model (the same ModelConfig), its
weights are the target's, loaded once.

The draft's forwards run on the engine thread before the target's, timed apart from them:
the draft has a step-cost model of its own (seeded at start as the target's is), so that the
price of a row's guesses counts the draft's forwards they take (runtime/speculation.py), and
the target's step-cost model learns the target's step alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from headroom.config import Config, ConfigError, SpeculativeConfig
from headroom.contracts.request import Request
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.executor import Executor
from headroom.models.loader import LoadedModel, default_model_path
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.step_cost import StepCostModel, attention_pairs
from headroom.runtime.suffix import Walk
from headroom.runtime.warmup import measure_step_cost

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """A request as the draft sees it: the tokens its cache holds or is about to hold."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    known: int = 0  # its first `known` tokens are the target's; guesses may follow
    lora = None  # the draft runs without adapters

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Drafter:
    def __init__(self, executor: Executor):
        self.executor = executor
        self.blocks = BlockManager(executor.num_blocks, executor.block_size, enable_prefix_caching=False)
        self.sequences: dict[str, Sequence] = {}
        self.cost = StepCostModel()  # what the draft's forwards cost
        self.spent_s = 0.0  # seconds the draft's forwards took in the last propose()

    @classmethod
    def build(cls, config: Config, target: Executor) -> Drafter:
        """The draft named by config.speculative.model, with a cache of as many tokens as the
        target's; ConfigError where its vocabulary is not the target's."""
        model = dataclasses.replace(config.model, model=config.speculative.model)
        target_path = config.model.model or default_model_path()
        same = os.path.realpath(config.speculative.model) == os.path.realpath(target_path)
        loaded: LoadedModel | None = target.loaded if same else None
        cache = dataclasses.replace(config.cache, num_blocks=target.num_blocks, block_size=target.block_size)
        off = SpeculativeConfig(method="off")
        draft = dataclasses.replace(config, model=model, cache=cache, lora=(), speculative=off)
        executor = Executor.build(draft, loaded)
        ours, theirs = executor.loaded.tokenizer.hf, target.loaded.tokenizer.hf
        if executor.loaded.args.vocab_size != target.loaded.args.vocab_size or ours.get_vocab() != theirs.get_vocab():
            raise ConfigError(
                f"speculative.model: {config.speculative.model!r} has another tokenizer than the model it drafts for"
            )
        log.info("draft model ready: %s", executor.describe())
        drafter = cls(executor)
        drafter.cost.prime(measure_step_cost(executor.runner, drafter.blocks))
        return drafter

    def propose(self, wanted: list[tuple[Request, int]]) -> list[Walk]:
        """k greedy guesses for each (request, k), in one forward per guessed position."""
        self.spent_s = 0.0
        walks = [Walk() for _ in wanted]
        rows: list[tuple[int, Sequence, int]] = []  # (index in wanted, its sequence, tokens to run)
        for i, (request, k) in enumerate(wanted):
            sequence = self._catch_up(request)
            todo = sequence.num_tokens - sequence.num_computed_tokens
            if self.blocks.allocate_slots(sequence, todo + k - 1) is None:
                continue  # no room in the draft's cache: this row decodes without guesses
            rows.append((i, sequence, todo))
        while rows:
            for (i, sequence, _), token in zip(rows, self._forward(rows), strict=True):
                walks[i].tokens.append(token)
                walks[i].chances.append(1.0)  # the row's measured acceptance decides
                sequence.all_token_ids.append(token)
            rows = [(i, s, 1) for i, s, _ in rows if len(walks[i].tokens) < wanted[i][1]]
        return walks

    def _catch_up(self, request: Request) -> Sequence:
        tokens = request.all_token_ids
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            sequence = self.sequences[request.request_id] = Sequence(request.request_id)
        else:
            sequence.num_computed_tokens = self._trusted(sequence, tokens)
        sequence.all_token_ids = list(tokens)
        sequence.known = len(tokens)
        return sequence

    @staticmethod
    def _trusted(sequence: Sequence, tokens: list[int]) -> int:
        """How many of the target's `tokens` the draft's cache holds: the guesses the target
        kept, not those after them, and never the newest token, whose logits the next guess
        needs (the target may have kept fewer guesses than were drafted, then taken the next
        as its own)."""
        same = sequence.known
        while same < min(sequence.num_tokens, len(tokens)) and sequence.all_token_ids[same] == tokens[same]:
            same += 1
        return min(sequence.num_computed_tokens, same, len(tokens) - 1)

    def pending(self, request: Request) -> int:
        """Tokens the draft runs for request before its first guess."""
        sequence = self.sequences.get(request.request_id)
        tokens = request.all_token_ids
        return len(tokens) - (0 if sequence is None else self._trusted(sequence, tokens))

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[int, Sequence, int]]) -> list[int]:
        """One draft forward over rows (sequence, tokens to run up to its last); the greedy
        token after each, in the order of rows."""
        order = sorted(range(len(rows)), key=lambda j: rows[j][2] > 1)  # decodes first
        pairs = [attention_pairs(n, sequence.num_computed_tokens) for _, sequence, n in rows]
        out = SchedulerOutput(
            requests=[rows[j][1] for j in order],
            num_scheduled_tokens=[rows[j][2] for j in order],
            num_decodes=sum(1 for _, _, n in rows if n == 1),
            attention_pairs=sum(pairs),
            decode_pairs=sum(p for p, (_, _, n) in zip(pairs, rows, strict=True) if n == 1),
        )
        started = time.perf_counter()
        result = self.executor.runner.execute(out, self.blocks, keep_hidden=False)
        chosen = result.logits.argmax(dim=-1).tolist()  # on a GPU, waits for the forward
        seconds = time.perf_counter() - started
        self.spent_s += seconds
        self.cost.observe(out.total_tokens, out.attention_pairs, seconds, out.decode_pairs)
        tokens = [0] * len(rows)
        for row, position in enumerate(result.sample_indices):
            j = order[position]
            tokens[j] = chosen[row]
            rows[j][1].num_computed_tokens += rows[j][2]
        return tokens

    def forget(self, request_id: str) -> None:
        if self.sequences.pop(request_id, None) is not None:
            self.blocks.free_request(request_id)
