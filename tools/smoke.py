"""`make smoke`: start `headroom serve` with its defaults as a user would, wait until it is
healthy, ask one chat question over HTTP, then SIGTERM it and expect a clean drain (exit 0).
Standard library only, so it runs in a venv with nothing but what serving needs; CI runs it
on the newest Python the project supports."""

from __future__ import annotations

import json
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 600.0  # a first start may build the CPU kernels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"smoke: the server exited with {server.returncode} before it was healthy")
        try:
            if get(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"smoke: not healthy after {START_TIMEOUT_S:.0f} s")


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    headroom = Path(sys.executable).parent / "headroom"
    log = tempfile.NamedTemporaryFile("w+", prefix="headroom-smoke-", suffix=".log")  # noqa: SIM115 - closed below
    started = time.monotonic()
    server = subprocess.Popen([str(headroom), "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server)
        healthy_s = time.monotonic() - started
        question = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        status, body = get(url + "/v1/chat/completions", question)
        if status != 200:
            raise SystemExit(f"smoke: chat answered {status}: {body}")
        [choice] = body["choices"]
        if not choice["message"]["content"].strip() or body["usage"]["completion_tokens"] < 1:
            raise SystemExit(f"smoke: an empty answer: {body}")
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        if code != 0:
            raise SystemExit(f"smoke: the server exited with {code} after SIGTERM")
    except BaseException:
        log.seek(0)
        print("smoke: the server's log, last lines:\n" + "".join(log.readlines()[-40:]), file=sys.stderr)
        raise
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        log.close()
    answer = choice["message"]["content"].strip()
    print(f"smoke: Python {platform.python_version()}: healthy in {healthy_s:.0f} s, answered {answer!r}, drained")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
