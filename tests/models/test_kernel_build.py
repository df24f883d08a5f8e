"""The kernel build cannot wedge a start: a build killed part-way leaves torch's `lock`
behind, on which torch's builder would wait for ever; the next start clears it at once."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from headroom.kernels import NAME, build_lock

pytestmark = pytest.mark.slow


def start_build(extensions: Path) -> subprocess.Popen:
    """`python -m headroom.kernels` building into its own empty cache, in a session
    of its own so that killing it kills its compilers too."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.Popen(
        [sys.executable, "-m", "headroom.kernels"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_build_killed_part_way_does_not_hold_up_the_next_start(tmp_path):
    first = start_build(tmp_path)
    try:
        # Part-way: torch has taken its lock and its compilers are running.
        deadline = time.monotonic() + 120
        locks = []
        while not locks and time.monotonic() < deadline and first.poll() is None:
            locks = list(tmp_path.glob(f"**/{NAME}/lock"))
            time.sleep(0.05)
        assert locks, "the first build never took torch's lock"
        time.sleep(1.0)
        assert first.poll() is None, "the first build ended before it could be killed"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    [lock] = locks
    assert lock.exists()  # what the killed build left behind

    second = start_build(tmp_path)
    started = time.monotonic()
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in second.stdout))
    reader.start()
    try:
        assert second.wait(600) == 0, "".join(line for _, line in lines)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(30)
        reader.join(30)
    cleared = [at for at, line in lines if "removing the build lock of a build that did not finish" in line]
    # At once (the bound is the new process's imports on a busy machine), not after torch's endless wait.
    assert cleared and cleared[0] - started < 60, lines
    assert "headroom CPU kernels: headroom's CPU kernels" in "".join(line for _, line in lines)
    assert not lock.exists()


def test_a_start_waits_for_a_live_build_and_leaves_its_lock_alone(tmp_path, caplog):
    torch_lock = tmp_path / "lock"
    torch_lock.touch()  # a live build's: it must survive until that build is done
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, sys\n"
                f"f = open({str(tmp_path / 'headroom.lock')!r}, 'a+')\n"
                "fcntl.flock(f, fcntl.LOCK_EX); f.write('4242'); f.flush()\n"
                "print('held', flush=True); sys.stdin.readline()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        entered = threading.Event()

        def start() -> None:
            with build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=start)
        waiter.start()
        assert not entered.wait(1.0) and torch_lock.exists()
        assert "waiting for process 4242, which is building headroom's CPU kernels" in caplog.text
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert entered.wait(30)
        waiter.join(30)
    finally:
        holder.kill()
        holder.wait(30)
    assert not torch_lock.exists()  # left by no live build once the holder was gone
    with open(tmp_path / "headroom.lock") as f:
        assert f.read() == str(os.getpid())
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
