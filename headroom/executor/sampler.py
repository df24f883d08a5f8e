"""Turns the last-position logits of each finishing sequence into its next token."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from headroom.contracts.request import Request
from headroom.executor import grammar

CPU = torch.device("cpu")


def first_max(rows: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim, the first of equal maxima as it returns: max's
    reduction is vectorised on the CPU where argmax's is not, and over a 49k vocabulary
    argmax took 2.4x as long (bench/RESULTS.md: a small model's decode step by part)."""
    return rows.max(dim=-1).indices


log = logging.getLogger("headroom.sampler")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives, best first: (token id, logprob).
    top: list[tuple[int, float]]


@dataclass
class SampleResult:
    token_ids: list[int]  # each row's (first) token
    logprobs: list[TokenLogprob | None]
    # Rows that verified guesses: the tokens after the first, with their logprobs.
    more: dict[int, list[tuple[int, TokenLogprob | None]]] = field(default_factory=dict)


class Sampler:
    """Samples where the logits are (on a GPU, only the chosen token ids come back to the
    host). A seed gives the same tokens on the same device; CPU and CUDA generators draw
    different streams."""

    def __init__(self, eos_token_ids: set[int], seed: int = 0, device: torch.device = CPU):
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        # Requests without a seed share one generator; seeded ones get their own, kept
        # across steps (and preemptions) so a seed always gives the same output.
        self.shared_generator = torch.Generator(device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def add(self, request: Request) -> None:
        if request.sampling.seed is not None:
            self.generators[request.request_id] = torch.Generator(self.device).manual_seed(request.sampling.seed)

    def remove(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]] | None = None
    ) -> SampleResult:
        """logits: (B, V), one row per request, then (where `drafts` gives request i guesses)
        one row after each guess, request by request: see verify."""
        if not drafts or not any(drafts):
            return self._sample_rows(logits, requests)
        plain = [i for i, guess in enumerate(drafts) if not guess]
        result = SampleResult([0] * len(requests), [None] * len(requests))
        if plain:
            part = self._sample_rows(logits[torch.tensor(plain, device=logits.device)], [requests[i] for i in plain])
            for row, i in enumerate(plain):
                result.token_ids[i], result.logprobs[i] = part.token_ids[row], part.logprobs[row]
        self.verify(logits, requests, drafts, result)
        return result

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        # logits: (B, V) float32, one row per request.
        logits = logits.float().to(self.device)
        raw = logits  # logprobs report the model's own distribution, as vLLM's do by default
        logits = self.adjust(logits, requests)
        banned = self._min_tokens_mask(requests, logits.shape[1])
        if banned is not None:
            logits = logits.masked_fill(banned, float("-inf"))
        constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:  # last, so that nothing after it can allow a token the grammar forbids
            logits = logits.clone() if logits is raw else logits
            grammar.mask(logits, constrained)
        greedy = [r.sampling.greedy for r in requests]
        tokens = first_max(logits)
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            picked = self._sample(logits[rows], [requests[i] for i in sampled_rows])
            tokens[rows] = picked
        token_ids = tokens.tolist()
        for i, constraint in constrained:
            if not constraint.matcher.accept_token(token_ids[i]):  # the grammar allowed nothing at all
                log.error("grammar refused token %d of %s; it ends here", token_ids[i], requests[i].request_id)
                token_ids[i] = self.eos_token_ids[0] if self.eos_token_ids else token_ids[i]
        return SampleResult(token_ids, self._logprobs(raw, tokens, token_ids, requests))

    def adjust(
        self, logits: torch.Tensor, requests: list[Request], outputs: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Penalties and logit_bias, for the whole batch in a few ops where the logits are;
        rows that ask for neither are untouched, and a batch without any costs nothing.
        outputs: each row's output so far, where it is not its request's (a guessed position
        is penalised as if the guesses before it were kept)."""
        penalized = [i for i, r in enumerate(requests) if r.sampling.penalized]
        biased = [(i, t, b) for i, r in enumerate(requests) for t, b in r.sampling.logit_bias]
        if not penalized and not biased:
            return logits
        logits = logits.clone()
        vocab, device = logits.shape[1], logits.device
        if penalized:
            rows = torch.tensor(penalized, device=device)
            chosen = [requests[i] for i in penalized]
            made = [outputs[i] if outputs is not None else requests[i].output_token_ids for i in penalized]
            part = logits[rows]
            if any(r.sampling.presence_penalty or r.sampling.frequency_penalty for r in chosen):
                frequency = torch.tensor([r.sampling.frequency_penalty for r in chosen], device=device)[:, None]
                presence = torch.tensor([r.sampling.presence_penalty for r in chosen], device=device)[:, None]
                counts = self._scatter(made, vocab, torch.float32, "add")
                part = part - frequency * counts - presence * (counts > 0)
            # The prompt too: only where asked, as it is the long list to walk every step.
            if any(r.sampling.repetition_penalty != 1.0 for r in chosen):
                every = [r.prompt_token_ids + m for r, m in zip(chosen, made, strict=True)]
                seen = self._scatter(every, vocab, torch.bool)
                repetition = torch.tensor([r.sampling.repetition_penalty for r in chosen], device=device)[:, None]
                part = torch.where(seen, torch.where(part > 0, part / repetition, part * repetition), part)
            logits[rows] = part
        if biased:
            index = torch.tensor([(i, t) for i, t, _ in biased], device=device)
            logits.index_put_(
                (index[:, 0], index[:, 1]), torch.tensor([b for _, _, b in biased], device=device), accumulate=True
            )
        return logits

    def _scatter(self, rows: list[list[int]], vocab: int, dtype: torch.dtype, reduce: str = "set") -> torch.Tensor:
        """(len(rows), vocab): per row, how often each token id occurs in it ("add") or
        whether it does ("set"). Rows are padded with `vocab`, a column dropped after."""
        width = max(1, max(len(r) for r in rows))
        ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], device=self.device)
        out = torch.zeros(len(rows), vocab + 1, dtype=dtype, device=self.device)
        ones = torch.ones_like(ids, dtype=dtype)
        out = out.scatter_add_(1, ids, ones) if reduce == "add" else out.scatter_(1, ids, ones)
        return out[:, :vocab]

    def _min_tokens_mask(
        self, requests: list[Request], vocab: int, made: list[int] | None = None
    ) -> torch.Tensor | None:
        """made: each row's output tokens so far, where it is not its request's count."""
        rows = []
        for i, r in enumerate(requests):
            p = r.sampling
            if (r.num_output_tokens if made is None else made[i]) < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                rows.extend((i, t) for t in stops if t < vocab)
        if not rows:
            return None
        mask = torch.zeros(len(requests), vocab, dtype=torch.bool, device=self.device)
        index = torch.tensor(rows, device=self.device)
        mask[index[:, 0], index[:, 1]] = True
        return mask

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return self._race(self._probs(logits, requests), requests)

    def _probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's distribution: temperature, then top-k and top-p."""
        temps = torch.tensor([r.sampling.temperature for r in requests], device=logits.device).unsqueeze(1)
        logits = logits / temps
        top_ks = [r.sampling.top_k for r in requests]
        top_ps = [r.sampling.top_p for r in requests]
        if any(top_ks) or any(p < 1 for p in top_ps):
            logits = self._top_k_top_p(logits, top_ks, top_ps)
        return logits.softmax(dim=-1)

    def _generator(self, request: Request) -> torch.Generator:
        return self.generators.get(request.request_id, self.shared_generator)

    def _race(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """A token from each row of (unnormalised) probs. Exponential race: argmax(p / E)
        with E ~ Exp(1) draws from p, one row per generator."""
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            noise[i].exponential_(generator=self._generator(r))
        return first_max(probs / noise)

    def verify(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]], result: SampleResult
    ) -> None:
        """The tokens of the rows that guessed, into `result`. Row i's logits after its last
        token are logits[i]; those after its guesses follow the B request rows, request by
        request. Greedy: the guesses are kept while each is the target's argmax, and the
        first argmax that differs (or the one after the last guess) is the row's own token,
        so the output is the one decoding without guesses gives. Sampled: each position is
        drawn from p as decoding draws it (the exponential race, one noise row of the
        request's generator a position), and a guess is kept while it equals the draw: the
        tokens follow the target distribution, a guess is kept with probability p(guess)
        (what rejection sampling with a proposer sure of its guess keeps), and a seeded
        request gives the same tokens with guesses as without. A row's tokens never depend
        on another's guesses. Penalties and min_tokens move with the tokens before a
        position: each guessed position is adjusted as if the guesses before it were kept,
        which is the only case in which it counts; a grammar's mask moves too, and its rows
        go position by position (_verify_constrained)."""
        logits = logits.to(self.device)
        index, owners, spans = [], [], []
        after = len(requests)
        for i, guess in enumerate(drafts):
            if not guess:
                continue
            spans.append((i, len(index), len(guess)))
            index += [i, *range(after, after + len(guess))]
            owners += [requests[i]] * (len(guess) + 1)
            after += len(guess)
        raw = logits[torch.tensor(index, device=logits.device)].float()
        # Each row's request and position: a position sees the guesses before it as output.
        places = [(i, j) for i, _, k in spans for j in range(k + 1)]
        outputs = None
        if any(r.sampling.penalized for r in owners):  # adjust reads a row's only where it is penalised
            outputs = [
                requests[i].output_token_ids + drafts[i][:j] if requests[i].sampling.penalized else []
                for i, j in places
            ]
        adjusted = self.adjust(raw, owners, outputs)
        made = [requests[i].num_output_tokens + j for i, j in places]
        banned = self._min_tokens_mask(owners, raw.shape[1], made)
        if banned is not None:
            adjusted = adjusted.masked_fill(banned, float("-inf"))
        targets = first_max(adjusted).tolist()
        sampled = [j for j, r in enumerate(owners) if not r.sampling.greedy and r.grammar is None]
        probs = {}
        if sampled:
            rows = torch.tensor(sampled, device=adjusted.device)
            probs = dict(zip(sampled, self._probs(adjusted[rows], [owners[j] for j in sampled]), strict=True))
        emitted: dict[int, list[int]] = {}
        for i, first, k in spans:
            request, guess = requests[i], drafts[i]
            if request.grammar is not None:
                emitted[i] = self._verify_constrained(adjusted[first : first + k + 1], request, guess)
                continue
            if request.sampling.greedy:
                kept = 0
                while kept < k and targets[first + kept] == guess[kept]:
                    kept += 1
                emitted[i] = guess[:kept] + [targets[first + kept]]
                continue
            # Each position drawn as decoding draws it, one noise row of the request's
            # generator after another, until a draw differs from the guess: the generator
            # then stands where decoding one token a step would have left it.
            tokens = []
            for j in range(k + 1):
                tokens.append(int(self._race(probs[first + j].unsqueeze(0), [request])[0]))
                if j == k or tokens[j] != guess[j]:
                    break
            emitted[i] = tokens
        lp_rows = [(first + j, i, t) for i, first, _ in spans for j, t in enumerate(emitted[i])]
        lp_rows = [(row, i, t) for row, i, t in lp_rows if requests[i].sampling.logprobs is not None]
        logprobs: dict[tuple[int, int], TokenLogprob | None] = {}
        if lp_rows:
            rows = torch.tensor([row for row, _, _ in lp_rows], device=raw.device)
            chosen = [t for _, _, t in lp_rows]
            found = self._logprobs(
                raw[rows], torch.tensor(chosen, device=raw.device), chosen, [owners[r] for r, _, _ in lp_rows]
            )
            logprobs = {(row, i): lp for (row, i, _), lp in zip(lp_rows, found, strict=True)}
        for i, first, _ in spans:
            tokens = emitted[i]
            result.token_ids[i], result.logprobs[i] = tokens[0], logprobs.get((first, i))
            result.more[i] = [(t, logprobs.get((first + j, i))) for j, t in enumerate(tokens) if j > 0]

    def _verify_constrained(self, adjusted: torch.Tensor, request: Request, guess: list[int]) -> list[int]:
        """A grammar row's tokens: each position masked by its matcher as it stands after
        the tokens before it, its token taken as _sample_rows takes one (a guess the grammar
        forbids is never the target's), and accepted into the matcher, until a token differs
        from the guess or ends the grammar. The matcher ends advanced by exactly the tokens
        returned."""
        constraint = request.grammar
        tokens = []
        for j in range(len(guess) + 1):
            row = adjusted[j : j + 1].clone()
            grammar.mask(row, [(0, constraint)])
            if request.sampling.greedy:
                token = int(first_max(row)[0])
            else:
                token = int(self._sample(row, [request])[0])
            if not constraint.matcher.accept_token(token):  # the grammar allowed nothing at all
                log.error("grammar refused token %d of %s; it ends here", token, request.request_id)
                tokens.append(self.eos_token_ids[0] if self.eos_token_ids else token)
                break
            tokens.append(token)
            if j == len(guess) or token != guess[j] or constraint.matcher.is_terminated():
                break
        return tokens

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        device = logits.device
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device).unsqueeze(1)
        drop = ranks >= ks
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        # Keep the smallest prefix whose mass reaches top_p (the best token always stays).
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], requests: list[Request]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(requests)
        if not wanted:
            return result
        rows = torch.tensor(wanted, device=raw.device)
        logprobs = raw[rows].log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[rows].unsqueeze(1))
        most = max(requests[i].sampling.logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(most, dim=-1)
        # One copy to the host for the whole batch: [chosen | top values | top ids] per
        # row (token ids are below 2**24, so exact in float32).
        host = torch.cat([chosen, top_vals, top_ids.float()], dim=1).tolist()
        for row, i in enumerate(wanted):
            n = requests[i].sampling.logprobs or 0
            values, ids = host[row][1 : 1 + most], host[row][1 + most :]
            result[i] = TokenLogprob(token_ids[i], host[row][0], [(int(t), v) for t, v in zip(ids[:n], values[:n])])
        return result
