"""The bench workload: Spec-Bench-style JSONL rows turned into requests.

A row is {"question_id", "category", "turns": [first user message, ...]}; only
the first turn is sent (as a chat message). Temperatures are dealt round-robin
within each category so every category sees the whole mix.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_PROMPT_CHARS = 200_000  # bounded input: a longer row is refused, not truncated
ADAPTIVE = "adaptive"  # the mode in which the gateway's policy chooses the arm


@dataclass(frozen=True)
class BenchRequest:
    idx: int  # position in the workload; measurements refer to it
    question_id: str
    category: str  # the dataset's category (reporting; sent only with --category-hints)
    prompt: str
    temperature: float
    seed: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("prompt")
        d["prompt_chars"] = len(self.prompt)
        return d


class WorkloadError(ValueError):
    pass


def read_rows(path: str | Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise ValueError("turns must be a non-empty list of strings")
            if len(turns[0]) > MAX_PROMPT_CHARS:
                raise ValueError(f"first turn longer than {MAX_PROMPT_CHARS} characters")
            row.setdefault("category", "unknown")
            row.setdefault("question_id", n)
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{path}:{n}: {e}") from None
        rows.append(row)
    if not rows:
        raise WorkloadError(f"{path}: no rows")
    return rows


def build_workload(rows: list[dict], per_category: int | None, temperatures: list[float], seed: int,
                   categories: list[str] | None = None, skip: int = 0) -> list[BenchRequest]:
    """The first `per_category` rows of each category (None: all) after its first
    `skip`, in file order of first appearance, interleaved across categories so that
    a prefix of the workload is a fair sample of it. `skip` gives a workload disjoint
    from the default's (what a policy's prior is fit on, to be judged on the default)."""
    if not temperatures:
        raise WorkloadError("at least one temperature")
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[str(r["category"])].append(r)
    cats = categories or list(by_cat)
    missing = [c for c in cats if c not in by_cat]
    if missing:
        raise WorkloadError(f"no rows for categories {missing}; present: {sorted(by_cat)}")
    picked = {c: by_cat[c][skip:skip + per_category] if per_category else by_cat[c][skip:] for c in cats}
    if not any(picked.values()):
        raise WorkloadError(f"no rows left after skipping each category's first {skip}")
    out: list[BenchRequest] = []
    depth = max(len(v) for v in picked.values())
    for k in range(depth):  # round k takes the k-th row of every category
        for j, c in enumerate(cats):
            if k < len(picked[c]):
                r = picked[c][k]
                # offset by the category's position: with one row per category the mix is still dealt out
                t = float(temperatures[(k + j) % len(temperatures)])
                out.append(BenchRequest(len(out), str(r["question_id"]), c, r["turns"][0], t,
                                        seed * 1_000_003 + len(out)))
    return out
