"""Training the draft head on the target's own outputs: soft cross-entropy to the
target's next-token distribution (over the draft vocabulary), for every
training-time-test step, with checkpoints to resume from."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.distill.data import Sample
from engines.distill.model import EagleHead

STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5)  # later steps matter less: fewer rounds get that far


@dataclass
class Chunk:
    tokens: torch.Tensor  # [n + 1]
    states: torch.Tensor  # [n, E]


def chunks(samples: list[Sample], n: int, prompt_context: int | None = None) -> list[Chunk]:
    """Windows of at most n positions over each sample: the whole of it, or (with
    `prompt_context`) the answer and that many prompt positions before it."""
    out = []
    for s in samples:
        L = s.states.shape[0]  # positions 0..L-1 have states; tokens has L + 1
        first = 0 if prompt_context is None else max(0, s.prompt_len - prompt_context)
        for a in range(first, L - 1, n):
            b = min(a + n, L)
            if b - a >= 4:
                out.append(Chunk(s.tokens[a:b + 1], s.states[a:b]))
    return out


def collate(batch: list[Chunk], n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded tokens [B, n + 1], states [B, n, E], lengths [B]."""
    E = batch[0].states.shape[1]
    tokens = torch.zeros(len(batch), n + 1, dtype=torch.long)
    states = torch.zeros(len(batch), n, E, dtype=torch.bfloat16)
    lengths = torch.tensor([c.states.shape[0] for c in batch])
    for i, c in enumerate(batch):
        tokens[i, : c.tokens.shape[0]] = c.tokens
        states[i, : c.states.shape[0]] = c.states
    return tokens, states, lengths


def step_losses(head: EagleHead, tokens, states, lengths, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss and, per step, the share of positions whose argmax matches the target's."""
    device = head.fc.device  # batches are collated on the host
    tokens, states, lengths = tokens.to(device), states.to(device), lengths.to(device)
    n = states.shape[1]
    outs = head(tokens, states, steps)
    p = head.target_probs(states[:, 1:])  # [B, n - 1, N]: the target at f_{j+1}
    target_top = p.argmax(-1)
    j = torch.arange(n - 1, device=device)
    total, agree = 0.0, []
    for s, out in enumerate(outs, start=1):
        valid = (j[None, :] + 1 < lengths[:, None]) & (j[None, :] >= s - 1)  # [B, n - 1]
        logq = head.logits(out[:, : n - 1]).log_softmax(-1)
        ce = -(p * logq).sum(-1)
        m = valid.float()
        total = total + STEP_WEIGHTS[s - 1] * (ce * m).sum() / m.sum().clamp_min(1)
        agree.append(float(((logq.argmax(-1) == target_top).float() * m).sum() / m.sum().clamp_min(1)))
    return total, agree


def train(head: EagleHead, samples: list[Sample], *, steps: int, seq_len: int, batch: int, lr: float, seed: int,
          checkpoint: Path | None, log: Callable[[str], None], tts_steps: int = 3, checkpoint_every: int = 100,
          time_budget_s: float | None = None) -> dict:
    """Train in place for `steps` optimizer steps, or until `time_budget_s` ends
    (the learning-rate schedule then runs on time: it reaches zero at whichever
    end comes first); resumes from `checkpoint` when it holds a state of this run."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = chunks(samples, seq_len)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, earlier_s, earlier_seen = 0, 0.0, 0  # what runs before a resume did: the card counts the whole
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors and numbers only: nothing executed
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        earlier_s, earlier_seen = float(state.get("train_s", 0.0)), int(state.get("seen", 0))
        log(f"resumed from {checkpoint} at step {start}")
    warm = max(1, steps // 20)

    def lr_at(k: int, progress: float) -> float:  # linear warm-up, then cosine to zero
        if k < warm:
            return lr * (k + 1) / warm
        return lr * 0.5 * (1 + math.cos(math.pi * progress))

    order: list[int] = []
    t0, seen, hist = time.monotonic(), 0, []
    for k in range(start, steps):
        progress = (k - warm) / max(1, steps - warm)
        if time_budget_s is not None:
            progress = max(progress, (time.monotonic() - t0) / max(time_budget_s, 1e-9))
            if progress >= 1:
                log(f"time budget reached at step {k}")
                steps = k
                break
        if len(order) < batch:
            order += rng.sample(range(len(data)), len(data))
        picked = [data[i] for i in order[:batch]]
        del order[:batch]
        tokens, states, lengths = collate(picked, seq_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(k, progress)
        loss, agree = step_losses(head, tokens, states, lengths, tts_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += int(lengths.sum())
        hist.append((float(loss.detach()), agree))
        done = k + 1 - start
        if done % 20 == 0 or k + 1 == steps:
            recent = hist[-20:]
            mean_agree = [sum(a[i] for _, a in recent) / len(recent) for i in range(tts_steps)]
            rate = seen / (time.monotonic() - t0)
            eta = (steps - k - 1) * (time.monotonic() - t0) / done
            log(f"train step {k + 1}/{steps}  loss {sum(x for x, _ in recent) / len(recent):.3f}  "
                f"top-1 agreement by step {' '.join(f'{a:.2f}' for a in mean_agree)}  "
                f"{rate:.0f} positions/s  eta {eta / 60:.1f} min")
        if checkpoint is not None and (k + 1) % checkpoint_every == 0:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": k + 1,
                        "train_s": earlier_s + time.monotonic() - t0, "seen": earlier_seen + seen}, checkpoint)
    return dict(steps=steps, positions_seen=earlier_seen + seen, chunks=len(data),
                train_s=round(earlier_s + time.monotonic() - t0, 1))


@torch.no_grad()
def agreement(head: EagleHead, samples: list[Sample], seq_len: int, tts_steps: int = 3) -> list[float]:
    """Top-1 agreement with the target per training-time-test step on held-out samples."""
    data = chunks(samples, seq_len, prompt_context=0)  # agreement on what the draft serves: answers
    sums, count = [0.0] * tts_steps, 0
    for i in range(0, len(data), 16):
        tokens, states, lengths = collate(data[i:i + 16], seq_len)
        _, agree = step_losses(head, tokens, states, lengths, tts_steps)
        w = int(lengths.sum())
        sums = [a * w + s for a, s in zip(agree, sums)]
        count += w
    return [s / max(count, 1) for s in sums]
