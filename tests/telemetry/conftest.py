import pytest
import redis

from telemetry.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def redis_server():
    server = PrivateRedis()  # a real redis-server on a loopback port
    yield server
    server.stop()


@pytest.fixture
def rclient(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()
