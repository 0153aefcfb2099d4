import json

import pytest

from tests.helpers import REPO, write_tiny_engine

SPECBENCH = REPO.parent / "shared" / "data" / "specbench-dev.jsonl"


@pytest.fixture(scope="session")
def specbench_rows():
    if not SPECBENCH.exists():
        pytest.skip(f"{SPECBENCH} not found (the shared/ data folder sits beside the checkout)")
    return [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def engine_config(tmp_path_factory):
    """A tiny model on disk and an engine config YAML naming it (for processes)."""
    return write_tiny_engine(tmp_path_factory.mktemp("tiny"))
