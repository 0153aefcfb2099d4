"""Train a draft for the target: an EAGLE-style head (one decoder layer reading
the target's hidden states, a head over the tokens it writes most) distilled
from the target's own answers, greedy and sampled, to its next-token
distributions. One command reproduces the shipped draft (about an hour on two
CPU cores; minutes on a GPU). Every stage is kept in the work directory: an
interrupted run resumes. Progress and ETA on stderr; the card records the
data, the training and the acceptance measured on held-out prompts."""

from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(p) -> None:
    from bench import default_data_path
    from engines.distill.run import Settings

    d = Settings(Path("."), Path("."), Path("."))
    p.add_argument("--config", help="engine config YAML naming the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=str(default_data_path()),
                   help="Spec-Bench JSONL whose prompts (minus the held-out ones) are answered (default: %(default)s)")
    p.add_argument("--out", help="where draft.safetensors and card.json go (default: the shipped draft's directory "
                                 "for the default target, else ./eagle-draft)")
    p.add_argument("--work-dir", help="data and checkpoints (default: <cache>/distill/<target>)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per optimizer step (default: %(default)s)")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="stop training after this long even if steps remain (default: none)")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch,
                   help="answers generated together; on a GPU, the rows of one padded batch (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=d.prompts,
                   help="prompts answered: the dev split's and the templates once, then templates again "
                        "(sampled answers differ); 0 = each once (default: %(default)s)")
    p.add_argument("--self-prompts", type=int, default=d.self_prompts,
                   help="then this many user turns the target writes itself (its chat template with the user turn "
                        "left open, T=1); those that end within 64 tokens and read as a request are answered "
                        "(default: %(default)s)")
    p.add_argument("--context-prompts", type=int, default=d.context_prompts,
                   help="then this many requests about passages of those answers: summaries, questions on the "
                        "passage, extraction, rewriting (default: %(default)s)")
    p.add_argument("--max-new", type=int, default=d.max_new, help="tokens per answer (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="draft vocabulary size (default: %(default)s)")
    p.add_argument("--held-out", type=int, default=d.held_out,
                   help="dev prompts per category kept for validation and the benchmarks (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the target config's)")


def main(args) -> int:
    import torch

    from engines.config import load_engine_config
    from engines.distill.run import Settings, run
    from engines.drafts import SHIPPED
    from engines.loading import default_cache_dir, default_target_path, load_model

    for flag, value, zero_ok in (("--steps", args.steps, False), ("--batch", args.batch, False),
                                 ("--gen-batch", args.gen_batch, False), ("--train-minutes", args.train_minutes, False),
                                 ("--context-prompts", args.context_prompts, True),
                                 ("--self-prompts", args.self_prompts, True)):
        if value is not None and (value < 0 if zero_ok else value <= 0):
            print(f"error: {flag} must be {'0 or more' if zero_ok else 'positive'}, got {value}", file=sys.stderr)
            return 2
    cfg = load_engine_config(args.config)
    t = cfg.target
    device = args.device or t.device
    cache = Path(t.cache_dir) if t.cache_dir else default_cache_dir()
    target = load_model(t.path or default_target_path(), torch.float32, device, cache)
    if device == "cpu":  # generate the data with whatever layout this CPU runs fastest
        from engines.profile import choose_layout

        prof = choose_layout(target.model, [target.model.weights], "auto", t.threads, t.bf16_matmuls)
        print(f"start-up profile: {prof.describe()}", file=sys.stderr)
    out = Path(args.out) if args.out else (SHIPPED if t.path is None else Path("eagle-draft"))
    work = Path(args.work_dir) if args.work_dir else cache / "distill" / Path(target.source).name
    s = Settings(Path(args.data), out, work, prompts=args.prompts, context_prompts=args.context_prompts,
                 self_prompts=args.self_prompts,
                 held_out=args.held_out, max_new=args.max_new,
                 vocab=args.vocab, steps=args.steps, batch=args.batch, gen_batch=args.gen_batch,
                 train_minutes=args.train_minutes, seed=args.seed)
    try:
        card = run(s, target)
    except KeyboardInterrupt:
        print(f"interrupted: run the same command to resume from {work}", file=sys.stderr)
        return 130
    v = card["validation"]
    print(f"wrote {out}: top-1 agreement by step {v['top1_agreement_by_step']}; "
          f"acceptance T=0 {v['T=0']['acceptance']}, T=0.7 {v['T=0.7']['acceptance']}")
    return 0
