"""The target writes its draft's training data: it answers prompts (greedy and
sampled), and every position of prompt and answer keeps the target's final
hidden state, the feature an EAGLE-style draft reads. On a CPU batched like
serving: one ragged target forward per step over every sequence, finished ones
replaced at once by the next prompt. On a GPU in padded batches of prompts of
similar length, one masked attention a layer for the whole batch
(LlamaModel.decode_padded): the ragged forward's launches per row would bound it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.api import SamplingParams
from engines.decode import sample_token, settle
from engines.llama import LlamaModel
from engines.sampling import Draws, logits_to_probs


@dataclass
class Sample:
    """One prompt and the target's answer, with its features."""

    tokens: torch.Tensor  # [L] long: prompt then answer
    states: torch.Tensor  # [L - 1, E · layers] bfloat16: the target's states at positions 0..L-2
    prompt_len: int
    category: str
    temperature: float

    @property
    def answer_len(self) -> int:
        return self.tokens.shape[0] - self.prompt_len


@dataclass
class _Row:
    idx: int
    ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    draws: Draws
    cache: object
    states: list[torch.Tensor]


def generate(model: LlamaModel, prompts: list[tuple[str, list[int], float]], max_new: int, eos_ids: frozenset[int],
             seed: int, layers: tuple[int, ...] = (-1,), batch: int = 48,
             on_done: Callable[[int, int], None] | None = None) -> list[Sample]:
    """prompts: (category, prompt token ids, temperature); `layers`: whose states
    to keep (-1: the final one; none: keep no states, Sample.states [L - 1, 0],
    for answers read as text only). Returns one Sample per prompt, in order.
    `on_done(done, answer_tokens)` reports progress."""
    if model.device.type != "cpu":
        return generate_padded(model, prompts, max_new, eos_ids, seed, layers, batch, on_done)
    out: list[Sample | None] = [None] * len(prompts)
    todo = list(range(len(prompts)))[::-1]
    rows: list[_Row] = []
    done = 0

    def admit() -> None:
        while todo and len(rows) < batch:
            i = todo.pop()
            _, ids, temp = prompts[i]
            g = Draws(seed * 1_000_003 + i)
            sp = SamplingParams(max_tokens=max_new, temperature=temp)
            row = _Row(i, list(ids), len(ids), sp, g, model.new_cache(len(ids) + max_new + 1), [])
            logits, states = _forward(model, [(torch.tensor(ids, device=model.device), row.cache, False)], layers)
            row.states.append(states[0].to(torch.bfloat16))
            first = sample_token(logits[0], sp, g, 0)
            row.ids.append(first)
            if first in eos_ids:
                finish(row)
            else:
                rows.append(row)

    def finish(row: _Row) -> None:
        nonlocal done
        cat, _, temp = prompts[row.idx]
        states = torch.cat(row.states)[: len(row.ids) - 1]
        out[row.idx] = Sample(torch.tensor(row.ids), states, row.prompt_len, cat, temp)
        done += 1
        if on_done is not None:
            on_done(done, len(row.ids) - row.prompt_len)

    admit()
    while rows:
        logits, states = _forward(model, [(torch.tensor([r.ids[-1]], device=model.device), r.cache, False)
                                          for r in rows], layers)
        keep = []
        for r, lg, st in zip(rows, logits, states):
            r.states.append(st.to(torch.bfloat16))
            produced = len(r.ids) - r.prompt_len
            emitted, eos = settle([sample_token(lg, r.sampling, r.draws, produced)], produced, r.sampling, eos_ids)
            r.ids.extend(emitted)
            if eos or len(r.ids) - r.prompt_len >= max_new:
                finish(r)
            else:
                keep.append(r)
        rows = keep
        admit()
    return [s for s in out if s is not None]


PREFILL_ROWS = 16  # prompts per prefill forward: their matmuls run once for all of them


def generate_padded(model: LlamaModel, prompts: list[tuple[str, list[int], float]], max_new: int,
                    eos_ids: frozenset[int], seed: int, layers: tuple[int, ...] = (-1,), batch: int = 256,
                    on_done: Callable[[int, int], None] | None = None) -> list[Sample]:
    """generate() for a GPU: the prompts by length in batches of `batch`, each
    prefilled row by row into one padded cache, then stepped together until every
    row has ended. Samples from the same distributions as generate() (not the
    same draws: one generator per batch)."""
    out: list[Sample | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    done = 0
    for first in range(0, len(order), batch):
        idx = order[first:first + batch]
        B = len(idx)
        g = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + first)
        cache = model.new_cache(max(len(prompts[i][1]) for i in idx) + max_new + 1, batch=B)
        temps = [prompts[i][2] for i in idx]
        ids = [list(prompts[i][1]) for i in idx]
        states: list[list[torch.Tensor]] = [[] for _ in idx]
        last = torch.empty(B, model.cfg.vocab_size, device=model.device)  # each row's next-token logits
        for a in range(0, B, PREFILL_ROWS):  # prefill: rows through their own views of the cache
            part = range(a, min(a + PREFILL_ROWS, B))
            views = [cache.row(b) for b in part]
            lg, st = _forward(model, [(torch.tensor(ids[b], device=model.device), v, False)
                                      for b, v in zip(part, views)], layers)
            for b, v, row_logits, row_states in zip(part, views, lg, st):
                cache.lengths[b] = v.lengths[0]
                last[b] = row_logits[0]
                states[b].append(row_states.to(torch.bfloat16).cpu())
        live = [True] * B
        step_states = []
        for produced in range(max_new):
            tokens = _sample_rows(last, temps, g).tolist()
            for b in range(B):
                if live[b]:
                    ids[b].append(tokens[b])
                    if tokens[b] in eos_ids or produced + 1 >= max_new:
                        live[b] = False
            if not any(live):
                break
            last, st = _decode(model, torch.tensor(tokens, device=model.device), cache, layers)
            step_states.append(st.to(torch.bfloat16))
        steps = torch.stack(step_states, dim=1).cpu() if step_states else None  # [B, steps, F]
        for b, i in enumerate(idx):
            cat, prompt, temp = prompts[i]
            n = len(ids[b]) - 1  # positions with a state: every one but the last token's
            row = torch.cat(states[b] + ([steps[b]] if steps is not None else []))[:n]
            out[i] = Sample(torch.tensor(ids[b]), row, len(prompt), cat, temp)
            done += 1
            if on_done is not None:
                on_done(done, len(ids[b]) - len(prompt))
    return [s for s in out if s is not None]


def _forward(model: LlamaModel, items: list, layers: tuple[int, ...]) -> tuple[list, list]:
    """forward_many's logits and each item's states [T_i, E · layers]: [T_i, 0] where
    `layers` names none, so that text-only stages hold no states (10,000 self-written
    turns kept ~3 GB of them)."""
    if layers:
        return model.forward_many(items, hidden=layers)
    return model.forward_many(items), [torch.empty(ids.shape[0], 0, dtype=torch.bfloat16) for ids, _, _ in items]


def _decode(model: LlamaModel, tokens: torch.Tensor, cache, layers: tuple[int, ...]):
    """decode_padded's logits [B, V] and states [B, E · layers] ([B, 0]: see _forward)."""
    if layers:
        return model.decode_padded(tokens, cache, hidden=layers)
    return model.decode_padded(tokens, cache), torch.empty(tokens.shape[0], 0, dtype=torch.bfloat16,
                                                           device=tokens.device)


def _sample_rows(logits: torch.Tensor, temps: list[float], g: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> one token per row [B], each at its own temperature."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for t in sorted(set(temps)):
        rows = torch.tensor([b for b, x in enumerate(temps) if x == t], device=logits.device)
        probs = logits_to_probs(logits[rows], SamplingParams(max_tokens=1, temperature=t))
        out[rows] = probs.argmax(-1) if t == 0 else torch.multinomial(probs, 1, generator=g)[:, 0]
    return out


class Progress:
    """A progress line with rate and ETA on stderr (redrawn on a terminal)."""

    def __init__(self, total: int, label: str, unit: str, log: Callable[[str], None]):
        self.total, self.label, self.unit, self.log = total, label, unit, log
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 10 and done < self.total:
            return
        self.last = now
        elapsed = now - self.t0
        eta = elapsed / max(done, 1e-9) * (self.total - done)  # 0 once done (an empty stage at once)
        share = done / self.total if self.total else 1.0
        self.log(f"{self.label}: {done}/{self.total} {self.unit} {100 * share:5.1f}%  "
                 f"elapsed {elapsed / 60:5.1f} min  eta {eta / 60:5.1f} min  {extra}")


def save_samples(path, samples: list[Sample]) -> None:
    """As safetensors (tensors only, nothing executable) plus the per-sample fields."""
    import json

    from safetensors.torch import save_file

    tensors = {}
    for i, s in enumerate(samples):
        tensors[f"{i}.tokens"] = s.tokens.to(torch.int32).contiguous()
        tensors[f"{i}.states"] = s.states.contiguous()
    meta = json.dumps([[s.prompt_len, s.category, s.temperature] for s in samples])
    save_file(tensors, str(path), metadata={"samples": meta})


def load_samples(path) -> list[Sample]:
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["samples"])
        return [Sample(f.get_tensor(f"{i}.tokens").long(), f.get_tensor(f"{i}.states"), p, c, t)
                for i, (p, c, t) in enumerate(meta)]
