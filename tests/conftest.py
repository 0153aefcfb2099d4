import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SPECBENCH = REPO.parent / "shared" / "data" / "specbench-dev.jsonl"


@pytest.fixture(scope="session")
def specbench_rows():
    if not SPECBENCH.exists():
        pytest.skip(f"{SPECBENCH} not found (the shared/ data folder sits beside the checkout)")
    return [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
