"""Fair order across tenants by virtual token counters (VTC; Sheng et al., "Fairness
in Serving Large Language Models", OSDI'24).

Each tenant's counter (`Tenant.vtc`) grows with the weighted tokens it is served:
prompt_weight * prompt + output_weight * output. The next request to admit comes from
the backlogged tenant with the smallest counter, so heavy users wait behind light ones.
A tenant that arrives with nothing queued has its counter lifted to the smallest
counter among backlogged tenants (or, with none backlogged, to that of the tenant most
recently admitted with nothing queued behind it: VTC's "last client to leave the
queue"), so time spent idle does not bank credit.

When to charge is the caller's choice; `Admission` charges an estimate on admission
and corrects it on settle (VTC with length prediction), so a tenant's counter moves as
soon as it takes a slot, not only when requests finish. With `device` on, the correction
charges what a request really cost the engine: its engine seconds, in weighted tokens at
the rate the engine has served them so far. A token deep in a long context costs far more
engine time than one in a short chat, and tenants share the device, not a token count.
"""

from __future__ import annotations

from collections.abc import Iterable

from headroom.admission.tenants import Tenant

RATE_ALPHA = 0.05  # how fast the tokens-per-engine-second rate follows new requests


class FairQueue:
    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0, device: bool = True):
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.device = device
        # Weighted tokens the engine serves per engine second, learned from settles.
        self.tokens_per_device_s: float | None = None
        self._last_drained: Tenant | None = None

    def charge(self, tenant: Tenant, prompt_tokens: float, output_tokens: float) -> None:
        """Add weighted service; negative counts correct an earlier estimate."""
        tenant.vtc += self.prompt_weight * prompt_tokens + self.output_weight * output_tokens

    def settle(self, tenant: Tenant, estimate: tuple[int, int], used: tuple[int, int], device_s: float) -> None:
        """Replace the admission-time estimate (prompt, output tokens) with what the
        request used: its engine seconds where known and `device` is on, else its tokens."""
        estimated = self.prompt_weight * estimate[0] + self.output_weight * estimate[1]
        tokens = self.prompt_weight * used[0] + self.output_weight * used[1]
        charge = tokens
        if self.device and device_s > 0:
            tenant.device_s += device_s
            if self.tokens_per_device_s is not None:
                charge = self.tokens_per_device_s * device_s
            if tokens > 0:  # learned after charging, so one request never sets its own rate
                rate = tokens / device_s
                old = self.tokens_per_device_s
                self.tokens_per_device_s = rate if old is None else old + RATE_ALPHA * (rate - old)
        tenant.vtc += charge - estimated

    def lift(self, tenant: Tenant, tenants: Iterable[Tenant]) -> None:
        """Call when `tenant` gets a request while it has nothing queued."""
        backlogged = [t.vtc for t in tenants if t.queue and t is not tenant]
        if backlogged:
            tenant.vtc = max(tenant.vtc, min(backlogged))
        elif self._last_drained is not None:
            tenant.vtc = max(tenant.vtc, self._last_drained.vtc)

    def drained(self, tenant: Tenant) -> None:
        """Call when `tenant` was admitted and has nothing left queued."""
        self._last_drained = tenant

    def next_tenant(self, candidates: Iterable[Tenant]) -> Tenant | None:
        """The tenant to admit from next: smallest counter among those with a queued
        request its own bucket would admit now (Tenant.next_waiter; ties by name). Tenants
        held back by their own limits are skipped, so spare capacity still goes to someone
        (work-conserving)."""
        best: Tenant | None = None
        for t in candidates:
            if t.next_waiter() is not None and (best is None or (t.vtc, t.name) < (best.vtc, best.name)):
                best = t
        return best
