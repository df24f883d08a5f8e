"""`headroom top`: a live terminal view of the costliest sequences, from the admin API.

It polls /admin/stats and /admin/sequences every interval and draws a header (KV
occupancy, queue, the head-of-line signal), the TTFT p99 of each size class over the last
minute, and a table of sequences by cost. Keys (when stdin is a terminal): j/k or the
arrows move the selection, a aborts the selected sequence, d deprioritizes it, q quits.
"""

from __future__ import annotations

import json
import os
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.request
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

TOKEN_ENV = "HEADROOM_ADMIN_TOKEN"
SORTS = ("cost", "kv_blocks", "age", "output_tokens", "progress")
ABORT_REASON = "aborted from headroom top"
HELP = "j/k or ↑/↓ select · a abort · d deprioritize · q quit"
ARROWS = {"\x1b[A": "k", "\x1bOA": "k", "\x1b[B": "j", "\x1bOB": "j"}


class AdminError(Exception):
    """A failed admin call, its message ready for the footer."""


class Client:
    def __init__(self, url: str, token: str, timeout: float = 5.0):
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + "/admin" + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            try:
                message = json.load(exc)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise AdminError(f"HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
            reason = getattr(exc, "reason", exc)
            raise AdminError(f"cannot reach {self.url} ({reason})") from None


@dataclass
class State:
    stats: dict | None = None
    rows: list[dict] | None = None
    selected: int = 0
    pinned: str | None = None  # the id the user moved to; the selection follows it while it lives
    error: str = ""  # the last poll's failure
    message: str = ""  # the last action's result

    @property
    def current(self) -> dict | None:
        return self.rows[self.selected] if self.rows else None


def poll(client: Client, state: State, sort: str) -> None:
    try:
        state.stats = client.call("GET", "/stats")
        state.rows = client.call("GET", f"/sequences?sort={sort}&limit=50")["data"]
        state.error = ""
    except AdminError as exc:
        state.error = str(exc)
        return
    ids = [row["id"] for row in state.rows]
    if state.pinned in ids:
        state.selected = ids.index(state.pinned)
    else:
        state.pinned = None
        state.selected = max(0, min(state.selected, len(ids) - 1))


def handle(key: str, client: Client, state: State) -> bool:
    """Apply one key; True when it changed something on the server (poll again now)."""
    if key in ("j", "k") and state.rows:
        step = 1 if key == "j" else -1
        state.selected = max(0, min(state.selected + step, len(state.rows) - 1))
        state.pinned = state.rows[state.selected]["id"]
        return False
    if key not in ("a", "d") or state.current is None:
        return False
    rid = state.current["id"]
    try:
        if key == "a":
            client.call("POST", f"/sequences/{rid}/abort", {"reason": ABORT_REASON})
            state.message = f"aborted {rid}"
        else:
            client.call("POST", f"/sequences/{rid}/deprioritize", {})
            state.message = f"deprioritized {rid}"
    except AdminError as exc:
        state.message = f"{'abort' if key == 'a' else 'deprioritize'} {rid} failed: {exc}"
    return True


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def render(url: str, sort: str, state: State) -> Group:
    parts: list = []
    stats = state.stats
    if stats is None:
        parts.append(Text(f"headroom top · {url} · waiting for the first answer", style="bold"))
    else:
        used, total = stats["kv_blocks_used"], stats["kv_blocks_total"]
        coupled = "yes" if stats["hol"]["coupled"] else "no"
        parts.append(
            Text(
                f"headroom top · {url} · KV {used}/{total} blocks ({100 * stats['kv_usage']:.0f}%) · "
                f"running {stats['running']} · waiting {stats['waiting']} · HOL coupled: {coupled}",
                style="bold",
            )
        )
        classes = stats["latency"].get("1m", {})
        line = (
            " · ".join(
                f"{name} {_num(c['ttft_p99_s'], '{:.3f}')}s (n={c['count']})" for name, c in sorted(classes.items())
            )
            or "no finished requests"
        )
        parts.append(Text(f"TTFT p99 (1m): {line}"))
        split = stats.get("split")
        if split:
            advice = {0.0: "", 10.0: " · plan a split", 50.0: " · two services on one pool"}[split["level"]]
            parts.append(
                Text(
                    f"pool spread (10m): largest {split['max_tokens']} tokens, median "
                    f"{split['median_tokens']:.0f} ({split['tokens_ratio']:.1f}x){advice}",
                    style="bold yellow" if split["level"] else None,
                )
            )
    table = Table(box=None, header_style="bold", pad_edge=False, title=f"sequences by {sort}", title_justify="left")
    for name in (
        "",
        "id",
        "tenant",
        "class",
        "state",
        "prompt",
        "out/max",
        "pred",
        "left",
        "p(cap)",
        "KV blocks",
        "dev s",
        "age s",
        "prio",
    ):
        table.add_column(
            name, no_wrap=True, justify="left" if name in ("", "id", "tenant", "class", "state") else "right"
        )
    for i, s in enumerate(state.rows or []):
        chosen = i == state.selected
        priority = "deprioritized" if s["deprioritized"] else str(s["priority"])
        table.add_row(
            ">" if chosen else "",
            s["id"],
            s["tenant"] or "-",
            s["size_class"] or "-",
            s["state"],
            str(s["prompt_tokens"]),
            f"{s['output_tokens']}/{s['max_tokens']}",
            _num(s["predicted_output_tokens"], "{:.0f}"),
            _num(s.get("predicted_remaining_tokens"), "{:.0f}"),
            _runaway(s),
            f"{s['kv_blocks']} ({100 * s['kv_share']:.0f}%)",
            _num(s["device_time_s"], "{:.2f}"),
            _num(s["age_s"]),
            priority,
            style="reverse" if chosen else None,
        )
    parts.append(table)
    if state.rows == []:
        parts.append(Text("no live sequences", style="dim"))
    parts.append(Text(HELP, style="dim"))
    if state.error:
        parts.append(Text(f"error: {state.error}", style="bold red"))
    if state.message:
        parts.append(Text(state.message))
    return Group(*parts)


def _runaway(s: dict) -> str:
    """The length probe's run-to-cap probability, with a ! once the sequence was flagged."""
    p = s.get("runaway_probability")
    if p is None:
        return "-"
    return f"{p:.2f}!" if s.get("runaway_flagged_at") is not None else f"{p:.2f}"


def keys_in(chunk: str) -> list[str]:
    for sequence, key in ARROWS.items():
        chunk = chunk.replace(sequence, key)
    return list(chunk)


def once(url: str, token: str, sort: str = "cost") -> int:
    """One poll printed as plain text: for scripts, pipes and logs."""
    client, state = Client(url, token), State()
    poll(client, state, sort)
    Console(width=200).print(render(url, sort, state))
    return 1 if state.error else 0


def run(url: str, token: str, interval: float = 1.0, sort: str = "cost") -> int:
    client, state = Client(url, token), State()
    interactive = sys.stdin.isatty()
    fd = sys.stdin.fileno() if interactive else -1
    saved = None
    try:
        if interactive:
            saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
        with Live(console=Console(), auto_refresh=False) as live:
            while True:
                poll(client, state, sort)
                live.update(render(url, sort, state), refresh=True)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    if not interactive:
                        time.sleep(left)
                        break
                    ready, _, _ = select.select([fd], [], [], left)
                    if not ready:
                        break
                    chunk = os.read(fd, 64).decode(errors="ignore")
                    if not chunk or "q" in chunk:  # end of input, or quit
                        return 0
                    acted = [handle(key, client, state) for key in keys_in(chunk)]  # every key, in order
                    if any(acted):
                        break  # an action: poll again now
                    live.update(render(url, sort, state), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def main(args) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"headroom top: no admin token (--token or {TOKEN_ENV})", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print("headroom top: --interval must be positive", file=sys.stderr)
        return 2
    if args.once or not sys.stdout.isatty():
        return once(args.url, token, args.sort)
    return run(args.url, token, args.interval, args.sort)
