"""A step's forward rerun in halves: the rows that can run get what they get
unbatched, from the cache lengths before the failed forward, and a row whose own
forward fails is isolated in a few forwards, not one per row."""

import pytest
import torch

from engines.forwards import rerun_in_halves
from tests.helpers import lean_from_hf, tiny_hf_model


def test_a_failed_forward_reruns_in_halves_from_the_lengths_before_it_and_isolates_its_culprit():
    model = lean_from_hf(tiny_hf_model())
    torch.manual_seed(0)
    seqs = [torch.randint(0, 30, (n,)) for n in (1, 4, 2, 3, 1)]
    alone = [model.forward_many([(s, model.new_cache(16), True)])[0] for s in seqs]
    items = [(s, model.new_cache(16), True) for s in seqs]
    forward, calls = model.forward_many, []

    def culprit_fails(rows, **kw):
        out = forward(rows, **kw)  # late: the caches already advanced
        calls.append(len(rows))
        if any(r is items[3] for r in rows):
            raise RuntimeError("bad row")
        return out
    model.forward_many = culprit_fails
    with pytest.raises(RuntimeError):
        culprit_fails(items)  # the step's own forward
    failed = []
    ran, outs, states = rerun_in_halves(model, items, [0] * 5, None, RuntimeError("bad row"),
                                        lambda i, e: failed.append(i))
    assert ran == [0, 1, 2, 4] and failed == [3] and states == [None] * 4
    for i, out in zip(ran, outs):
        torch.testing.assert_close(out, alone[i], rtol=1e-12, atol=1e-12)
        assert items[i][1].lengths[0] == len(seqs[i])  # from 0 again, not from the failed forward's lengths
    # halves of 2 and 3 rows, the failing three as 1 and 2, the failing two as 1 and 1 (a batch of 16 with one
    # culprit: 8 forwards where row by row took 16; one merely too large: 2)
    assert calls[1:] == [2, 3, 1, 2, 1, 1]
