import pytest

from tests.helpers import start_gateway


@pytest.fixture(scope="module")
def gw():
    """A real gateway on a loopback port in front of a tiny in-process engine."""
    g = start_gateway()
    yield g
    g.close()
