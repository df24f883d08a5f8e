"""`headroom top` in a pseudo-terminal against the real server: it shows the planted
runaway first and selected, `a` aborts it (the client's stream ends with the admin's
reason), the footer says so, and `q` quits with status 0."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading

import pytest

from tests.admin.conftest import ADMIN_TOKEN, admin, plant_runaway, start_stream, wait_until
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


class Screen:
    """Everything the process wrote to the terminal, ANSI codes stripped; read by a thread."""

    def __init__(self, fd: int):
        self.fd, self.text, self.lock = fd, "", threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: the process has exited and closed its end
                return
            if not data:
                return
            with self.lock:
                self.text += ANSI.sub("", data.decode(errors="replace"))

    def mark(self) -> int:
        with self.lock:
            return len(self.text)

    def wait_for(self, pattern: str, since: int = 0, timeout: float = 30.0) -> re.Match:
        def found():
            with self.lock:
                return re.search(pattern, self.text[since:])

        match = wait_until(found, timeout=timeout, interval=0.1)
        assert match, f"{pattern!r} not on the screen; its end:\n{self.text[-3000:]}"
        return match


def test_top_shows_the_runaway_first_and_aborts_it(admin_server):
    engine = admin_server.engine
    wait_idle(engine, timeout=30)
    rid = "cmpl-top-runaway"
    runaway = plant_runaway(admin_server, "top-runaway")
    shorts = [
        start_stream(admin_server, {"prompt": "Hi", "max_tokens": 100, "ignore_eos": True}, request_id=f"top-short{i}")
        for i in range(2)
    ]

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm-256color"}
    env.pop("HEADROOM_ADMIN_TOKEN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headroom.app.cli",
            "top",
            "--url",
            admin_server.url,
            "--token",
            ADMIN_TOKEN,
            "--interval",
            "0.5",
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
        start_new_session=True,
    )
    os.close(slave)
    screen = Screen(master)
    try:
        screen.wait_for(r"headroom top · " + re.escape(admin_server.url) + r" · KV \d+/512 blocks")
        screen.wait_for(r"TTFT p99 \(1m\)")
        # The runaway is the costliest once its long prompt is in: the first row, selected.
        assert wait_until(
            lambda: admin(admin_server, "GET", "/sequences?sort=cost&limit=1").json()["data"][0]["id"] == rid,
            timeout=30,
        )
        screen.wait_for(r">\s+" + re.escape(rid) + r"\s+default\s", since=screen.mark())
        since = screen.mark()
        os.write(master, b"a")
        runaway.wait(timeout=30)
        final = runaway.final_choice
        assert runaway.finish_reason == "abort"
        assert final["stop_reason"] == "aborted by admin: aborted from headroom top"
        screen.wait_for("aborted " + re.escape(rid), since=since)
        assert all(s.request_id != rid for s in engine.snapshot().sequences)

        os.write(master, b"q")
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        screen.thread.join(timeout=5)
        os.close(master)
    for s in shorts:
        s.wait(timeout=60)
    wait_idle(engine, timeout=30)
    engine.block_manager.check_invariants()


def test_top_without_a_terminal_prints_once_in_every_documented_order(admin_server):
    """Piped (no terminal), `headroom top` prints one view and exits; every order the
    admin API documents is one it takes."""
    stream = start_stream(admin_server, {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True}, request_id="top-once")
    try:
        assert wait_until(
            lambda: any(s.request_id == "cmpl-top-once" for s in admin_server.engine.snapshot().sequences)
        )
        env = {k: v for k, v in os.environ.items() if k != "HEADROOM_ADMIN_TOKEN"}
        for sort in ("cost", "kv_blocks", "kv_block_seconds", "age", "output_tokens", "progress"):
            run = subprocess.run(
                [sys.executable, "-m", "headroom.app.cli", "top", "--url", admin_server.url, "--token", ADMIN_TOKEN]
                + ["--sort", sort],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                check=False,
            )
            assert run.returncode == 0, (sort, run.stderr[-2000:])
            assert f"sequences by {sort}" in run.stdout and "cmpl-top-once" in run.stdout, run.stdout
    finally:
        admin(admin_server, "POST", "/sequences/cmpl-top-once/abort")
        stream.wait(timeout=60)
    wait_idle(admin_server.engine, timeout=30)
