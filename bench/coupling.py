"""What coupled sampling costs a model draft, and the constants it picks with
(engines/sampling.py: HEAD_SHARE, SHARPEN), simulated on the draft's real rounds.

The dev prompts (`--per-category`, from each category's last, so none of the
benchmarks' first three) are served under the draft at fixed γ with speculative
sampling, and every verified position's target p and draft q recorded (their
`--keep` likeliest tokens). Then per temperature: speculative sampling's
acceptance per drafted token (Σ min(p, q)), and how often a coupled guess
matches the target's pick, under `--noises` Gumbel draws per position: with
every token its own noise at each scale of the draft's noise, and with the head
and the tail as `Draws.pick` forms them at each head share.

    .venv/bin/python bench/coupling.py
    .venv/bin/python bench/coupling.py --arm eagle:3 --temperatures 0.7 1.0 --per-category 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import cpu_model, default_data_path

SCALES = (1.0, 0.9, 0.75, 0.5)
SHARES = (1e-2, 1e-3, 1e-4)


def record(arm: str, temperatures: list[float], rows: list[dict], max_tokens: int, keep: int, config: str | None):
    """Per temperature: (p, q) [positions, keep] over each position's `keep` likeliest tokens (by p + q)."""
    import torch

    import engines.decode as decode
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    verify = decode.rejection_sample

    def spy(draft_ids, draft_probs, target_probs, u_sample, u_accept):
        if draft_probs is not None:  # a model draft's round (lookup's q is one-hot)
            for i in range(draft_ids.shape[0]):
                top = torch.topk(target_probs[i] + draft_probs[i], keep).indices
                seen.append((target_probs[i][top].double(), draft_probs[i][top].double()))
        return verify(draft_ids, draft_probs, target_probs, u_sample, u_accept)

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    out = {}

    def serve():
        for t in temperatures:
            seen.clear()
            for i, row in enumerate(rows):
                engine.submit(GenerationRequest(
                    f"{t}-{i}", messages=(ChatMessage("user", row["turns"][0]),), arm=Arm.parse(arm),
                    fixed_gamma=True, sampling=SamplingParams(max_tokens=max_tokens, temperature=t, seed=i))).wait(600)
            p, q = (torch.stack(x) for x in zip(*seen))
            out[t] = (p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True))

    decode.rejection_sample = spy
    try:
        drive_from_side_thread(engine, serve)
    finally:
        decode.rejection_sample = verify
    return out


def picks(P, G, g_tail, u_tail, share: float | None, scale: float):
    """Each position's pick under each noise draw [S, N]: Gumbel-max over every token
    (share None), or over the head (within `share` of the likeliest) and the tail as one
    item, a tail token by inverting its cumulative sum in index order."""
    import torch

    logp = torch.log(P.clamp_min(1e-300))
    if share is None:
        return (logp + scale * G).argmax(-1)
    head = P >= P.max(1, keepdim=True).values * share  # [N, V]
    tail = (P * ~head).sum(1)  # [N]
    best, arg = (torch.where(head, logp, -torch.inf) + scale * G).max(-1)  # [S, N]
    tail_wins = torch.where(tail > 0, torch.log(tail.clamp_min(1e-300)), -torch.inf) + scale * g_tail > best
    cdf = torch.cumsum(P * ~head, 1) / tail.clamp_min(1e-300)[:, None]  # [N, V]
    in_tail = torch.stack([torch.searchsorted(cdf, u[:, None]).squeeze(1) for u in u_tail]).clamp_max(P.shape[1] - 1)
    return torch.where(tail_wins, in_tail, arg), tail_wins.double().mean().item()


def simulate(p, q, noises: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)

    def gumbel(*shape):
        return -torch.log(-torch.log(torch.rand(*shape, generator=g, dtype=torch.float64)))

    G, g_tail, u_tail = gumbel(noises, *p.shape), gumbel(noises, p.shape[0]), torch.rand(noises, p.shape[0],
                                                                                           generator=g,
                                                                                           dtype=torch.float64)
    out = {"positions": p.shape[0], "speculative": torch.minimum(p, q).sum(1).mean().item(), "every_token": {},
           "head": {}}
    target = picks(p, G, g_tail, u_tail, None, 1.0)
    for c in SCALES:
        out["every_token"][c] = (picks(q, G, g_tail, u_tail, None, c) == target).double().mean().item()
    for share in SHARES:
        target, tail_won = picks(p, G, g_tail, u_tail, share, 1.0)
        out["head"][share] = {"tail_won": tail_won, **{c: (picks(q, G, g_tail, u_tail, share, c)[0] == target)
                                                        .double().mean().item() for c in (1.0, 0.75)}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    ap.add_argument("--arm", default="eagle:3", help="a model draft at fixed γ (default: %(default)s)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.7, 1.0], help="(default: %(default)s)")
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category, from its last (default: 1)")
    ap.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    ap.add_argument("--keep", type=int, default=512, help="tokens kept per position, by p + q (default: 512)")
    ap.add_argument("--noises", type=int, default=200, help="Gumbel draws per position (default: %(default)s)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    picked = [r for cat in by_cat.values() for r in cat[::-1][:args.per_category]]
    print(f"machine: {cpu_model()}; {len(picked)} prompts, {args.arm} at fixed γ, {args.max_tokens} tokens")
    figures = {}
    for t, (p, q) in record(args.arm, args.temperatures, picked, args.max_tokens, args.keep, args.config).items():
        f = figures[t] = simulate(p, q, args.noises)
        print(f"T={t:g}: {f['positions']} drafted positions; speculative sampling accepts {f['speculative']:.3f} "
              "per drafted token; coupled guesses match the target's pick:")
        print("  every token its own noise, by the draft's noise scale: "
              + ", ".join(f"{c:g}: {v:.3f}" for c, v in f["every_token"].items()))
        for share, h in f["head"].items():
            print(f"  head share {share:g} (the tail won {h['tail_won']:.1%} of the target's picks): "
                  f"unscaled {h[1.0]:.3f}, scaled 0.75 {h[0.75]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "cpu": cpu_model(), "figures": figures},
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
