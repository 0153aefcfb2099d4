"""One step's target forward over its rows, and its rerun when it fails.

A row is (input ids [T], its KV cache, whether it wants logits at every input
position). A forward that raises may do so late (the caches already written and
advanced): a rerun starts each row again from the cache length it had before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engines.llama import LlamaModel

log = logging.getLogger(__name__)


def forward_rows(model: LlamaModel, items: list, layer: int | None) -> tuple[list[torch.Tensor], list]:
    """Logits of these rows, and the hidden states at `layer` (None: none)."""
    if layer is not None:
        return model.forward_many(items, hidden=layer)
    return model.forward_many(items), [None] * len(items)


def rerun_in_halves(model: LlamaModel, items: list, lengths: list[int], layer: int | None, error: Exception,
                    fail: Callable[[int, Exception], None]) -> tuple[list[int], list[torch.Tensor], list]:
    """After a forward of `items` failed with `error` (a batch too large for the
    memory left, or one row tripping a bug): the rows again from `lengths`, in
    halves, and a failing half in halves again down to single rows. A batch too
    large runs in two or four forwards rather than one per row; a single row whose
    own forward fails is passed to `fail` (its index) and left out. Returns the
    indices of the rows that ran, in order, with their logits and states."""
    log.warning("a forward of %d rows failed (%s: %s): rerunning them in halves", len(items),
                type(error).__name__, error)
    kept, outs, states = [], [], []
    h = len(items) // 2
    todo = [range(h, len(items)), range(h)]  # popped from the end: in row order
    while todo:
        part = todo.pop()
        for i in part:
            items[i][1].lengths[0] = lengths[i]
        try:
            out, state = forward_rows(model, [items[i] for i in part], layer)
        except Exception as e:  # noqa: BLE001 - split again; a single row's own forward fails that row alone
            if len(part) == 1:
                fail(part[0], e)
            else:
                h = len(part) // 2
                todo += [part[h:], part[:h]]
            continue
        kept += part
        outs += out
        states += state
    return kept, outs, states
