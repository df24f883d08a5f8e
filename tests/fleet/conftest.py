from __future__ import annotations

import pytest

from tests.fleet.redis_server import RedisServer, free_port


@pytest.fixture
def redis_server():
    server = RedisServer(free_port()).start()
    yield server
    server.stop()
