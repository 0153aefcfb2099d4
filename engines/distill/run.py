"""The whole of `specgate distill`, stage by stage; every stage's result is kept
in the work directory, so an interrupted run resumes where it stopped. A kept
result is named by a key of everything that made it (the target, the prompts,
the flags that shape it): a run with other settings makes its own instead of
reusing one made otherwise.

    1. prompts      the dev split minus the benchmarks' prompts, the templates, and
                    (optionally) requests the target writes itself
    2. data         the target answers them (greedy and sampled) and keeps its states;
                    then, optionally, requests about its own answers (summaries,
                    questions on a passage, rewriting), answered the same way
    3. vocabulary   the tokens the target writes most, then its own most common ids
    4. training     soft cross-entropy with training-time test, checkpointed
    5. validation   on the held-out prompts: top-1 agreement per step, and real
                    speculative decoding with the new draft (acceptance, length)
    6. artifact     draft.safetensors and card.json (with the target's fingerprint)
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.distill import data, prompts, train
from engines.distill.model import EagleHead
from engines.loading import LoadedModel, fingerprint


@dataclass
class Settings:
    data_path: Path
    out: Path
    work: Path
    prompts: int = 1400  # the dev split's and the templates once, then templates again (0: every prompt once)
    context_prompts: int = 0  # requests about passages of the first answers (prompts.context_prompts)
    self_prompts: int = 0  # user turns the target is asked to write (self_prompt_set); those kept are answered
    held_out: int = 3
    max_new: int = 192
    gen_batch: int = 64
    vocab: int = 8192
    feature_layers: tuple[int, ...] = (2, 15, -1)
    steps: int = 1100
    batch: int = 8
    train_minutes: float | None = None  # stop training there if the steps take longer
    seq_len: int = 256
    lr: float = 6e-4
    tts_steps: int = 3
    seed: int = 0
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.7, 1.0)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def encode(tokenizer, text: str, limit: int = 1536) -> list[int]:
    ids = tokenizer(render_chat_text(tokenizer, text), add_special_tokens=False)["input_ids"]
    return ids[-limit:]  # a long document keeps its end, where the instruction is


SELF_PROMPT_TOKENS = 64  # a user turn the target writes is kept only if it ends within these


def self_prompt_set(s: Settings, target: LoadedModel, key: str) -> tuple[list[str], int]:
    """Requests the target writes itself: its chat template up to an open user
    turn, sampled at T=1 (Magpie), kept where the turn ends and reads as a
    request (prompts.written_requests). Returns (kept texts, turns written)."""
    tok = target.tokenizer
    marker = "<<request>>"
    opened = render_chat_text(tok, marker)
    prefix = tok(opened[: opened.index(marker)], add_special_tokens=False)["input_ids"]
    items = [("self", prefix, 1.0)] * s.self_prompts
    turns = generated(s, target, "self-prompts", items, SELF_PROMPT_TOKENS, s.seed + 3, key, layers=())  # read as text
    eos = _eos(target)
    ended = [x.answer_len > 0 and int(x.tokens[-1]) in eos for x in turns]
    written = [(tok.decode(x.tokens[x.prompt_len: len(x.tokens) - e].tolist(), skip_special_tokens=True), e)
               for x, e in zip(turns, ended)]
    return prompts.written_requests(written), len(turns)


def render_chat_text(tokenizer, text: str) -> str:
    from engines.api import ChatMessage
    from engines.text import render_chat

    return render_chat(tokenizer, (ChatMessage("user", text),))


def prompt_set(s: Settings, tokenizer, written: list[str] = ()) -> tuple[list, list, dict]:
    rng = random.Random(s.seed)
    train_dev, valid_dev = prompts.dev_split(s.data_path, s.held_out)
    templates = prompts.template_prompts(rng)
    pool = train_dev + templates
    while len(pool) < s.prompts:  # sampled answers differ: a prompt may be answered twice
        pool += [p for p in templates]
    pool = pool[: s.prompts or len(pool)] + [("self", t) for t in written]
    rng.shuffle(pool)
    temps = s.temperatures
    sampled = [t for t in temps if t > 0] or list(temps)  # all greedy: repeats stay greedy
    answered: set = set()

    def temperature(i: int, p: tuple[str, str]) -> float:  # a greedy answer twice would be the same answer
        t = temps[i % len(temps)] if p not in answered else sampled[i % len(sampled)]
        answered.add(p)
        return t

    train_prompts = [(c, encode(tokenizer, t), temperature(i, (c, t))) for i, (c, t) in enumerate(pool)]
    valid_prompts = [(c, encode(tokenizer, t), 0.0) for c, t in valid_dev]
    dev = set(train_dev)
    info = dict(dev_prompts=sum(1 for p in pool if p in dev),
                template_prompts=sum(1 for p in pool if p not in dev and p[0] != "self"),
                self_prompts=len(written),
                held_out_per_category=s.held_out, validation_prompts=len(valid_prompts),
                temperatures=list(temps), max_new_tokens=s.max_new)
    return train_prompts, valid_prompts, info


def context_set(s: Settings, tokenizer, samples: list) -> list:
    """Requests about passages of the target's first answers: the greedy and
    T=0.7 ones long enough to summarise (T=1 answers of a small model wander)."""
    texts = [tokenizer.decode(x.tokens[x.prompt_len:].tolist(), skip_special_tokens=True).strip()
             for x in samples if x.answer_len >= 64 and x.temperature < 1.0]
    pairs = prompts.context_prompts(random.Random(s.seed + 1), texts, s.context_prompts)
    return [(c, encode(tokenizer, t), s.temperatures[i % len(s.temperatures)]) for i, (c, t) in enumerate(pairs)]


def stage_key(*parts) -> str:
    """A short key of what made a stage's result (JSON-serialisable parts)."""
    return hashlib.sha256(json.dumps(parts, default=list).encode()).hexdigest()[:12]


def generated(s: Settings, target: LoadedModel, name: str, items: list, max_new: int, seed: int,
              key: str, layers: tuple[int, ...] | None = None) -> list:
    """The target's answers and states (of `layers`, by default the draft's feature
    layers; () keeps none), generated once and kept in the work directory under
    `key` (the target's fingerprint, the settings) and the prompts."""
    layers = s.feature_layers if layers is None else tuple(layers)
    path = s.work / f"{name}-{stage_key(key, items, max_new, seed, layers)}.safetensors"
    if path.exists():
        log(f"{name}: using {path}")
        return data.load_samples(path)
    eos = _eos(target)
    progress = data.Progress(len(items), f"{name} data", "prompts", log)
    answer_tokens = [0]

    def on_done(done: int, n: int) -> None:
        answer_tokens[0] += n
        progress.update(done, f"{answer_tokens[0]} answer tokens")

    samples = data.generate(target.model, items, max_new, eos, seed, layers, s.gen_batch, on_done)
    progress.update(len(items), f"{answer_tokens[0]} answer tokens", force=True)
    data.save_samples(path, samples)
    return samples


def _eos(target: LoadedModel) -> frozenset[int]:
    ids = set()
    for src in (getattr(target.hf_config, "eos_token_id", None), target.tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return frozenset(ids)


def vocabulary(samples: list, size: int, vocab_total: int) -> torch.Tensor:
    """The draft's tokens: most written in answers (weighted 3x) and prompts, then
    the lowest ids (byte-pair merges learned first: the most common text)."""
    count: collections.Counter = collections.Counter()
    for smp in samples:
        toks = smp.tokens.tolist()
        count.update(toks[: smp.prompt_len])
        for t in toks[smp.prompt_len:]:
            count[t] += 3
    chosen = [t for t, _ in count.most_common(size)]
    seen = set(chosen)
    for t in range(vocab_total):
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t)
    return torch.tensor(sorted(chosen[:size]))


def validate(head: EagleHead, valid: list, target: LoadedModel, s: Settings, artifact: Path) -> dict:
    """Agreement on held-out answers, then the draft for real: speculative
    decoding on the held-out prompts through the engine (greedy and T=0.7)."""
    agree = train.agreement(head, valid, s.seq_len, s.tts_steps)
    out = {"top1_agreement_by_step": [round(a, 4) for a in agree]}
    from engines.api import GenerationRequest, SamplingParams
    from engines.arms import Arm
    from engines.builtin import BuiltinEngine
    from engines.config import EagleDraftConfig, EngineConfig
    from engines.drafts import build_drafts

    cfg = EngineConfig(drafts=[EagleDraftConfig(path=str(artifact))], adaptive=False, max_batch=64)
    drafts = build_drafts(cfg, target, s.work)
    engine = BuiltinEngine(target, drafts.factories, cfg, start_worker=True)
    try:
        for temp in (0.0, 0.7):
            handles = [engine.submit(GenerationRequest(
                request_id=f"v{i}", prompt_token_ids=tuple(v.tokens[: v.prompt_len].tolist()), arm=Arm("eagle", 3),
                sampling=SamplingParams(max_tokens=96, temperature=temp, seed=i))) for i, v in enumerate(valid)]
            stats = [h.wait(1800).stats for h in handles]
            drafted, accepted = sum(x.drafted for x in stats), sum(x.accepted for x in stats)
            rounds, tokens = sum(x.rounds for x in stats), sum(x.output_tokens for x in stats)
            out[f"T={temp:g}"] = {"acceptance": round(accepted / max(drafted, 1), 4),
                                  "mean_accepted_length": round((accepted + rounds) / max(rounds, 1), 3),
                                  "gamma": 3, "requests": len(stats), "tokens": tokens}
    finally:
        engine.close()
    return out


def command(s: Settings, device: str) -> str:
    """The `specgate distill` command line that makes this draft again."""
    flags = {"--prompts": "prompts", "--self-prompts": "self_prompts", "--context-prompts": "context_prompts",
             "--max-new": "max_new",
             "--vocab": "vocab", "--held-out": "held_out",
             "--steps": "steps", "--batch": "batch", "--gen-batch": "gen_batch", "--train-minutes": "train_minutes",
             "--seed": "seed"}
    out = ["specgate distill"] + ([f"--device {device.split(':')[0]}"] if device != "cpu" else [])
    out += [f"{f} {getattr(s, a)}" for f, a in flags.items() if getattr(s, a) != getattr(Settings, a)]
    return " ".join(out)


def run(s: Settings, target: LoadedModel) -> dict:
    from engines.proposers.eagle import save_draft

    t_start = time.monotonic()
    s.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.seed)
    print_ = fingerprint(target)
    log(f"target {target.source}: {print_}")
    written, asked = self_prompt_set(s, target, print_) if s.self_prompts else ([], 0)
    if asked:
        log(f"the target wrote {asked} user turns: {len(written)} kept as requests")
    train_prompts, valid_prompts, info = prompt_set(s, target.tokenizer, written)
    if asked:
        info["self_prompts_written"] = asked
    log(f"{len(train_prompts)} training prompts ({info['dev_prompts']} from the dev split, "
        f"{len(written)} written by the target), "
        f"{len(valid_prompts)} held out for validation")
    samples = generated(s, target, "train", train_prompts, s.max_new, s.seed, print_)
    if s.context_prompts:
        context = context_set(s, target.tokenizer, samples)
        log(f"{len(context)} requests about passages of those answers")
        samples = samples + generated(s, target, "context", context, s.max_new, s.seed + 2, print_)
        info["context_prompts"] = len(context)
    valid = generated(s, target, "validation", valid_prompts, 128, s.seed + 1, print_)
    ids = vocabulary(samples, s.vocab, target.model.cfg.vocab_size)
    answers = [t for v in valid for t in v.tokens[v.prompt_len:].tolist()]
    covered = float(torch.isin(torch.tensor(answers), ids).float().mean()) if answers else 0.0
    log(f"vocabulary: {ids.numel()} tokens cover {covered:.3f} of the held-out answers' tokens")
    head = EagleHead(target.model.weights, target.model.cfg, ids, s.feature_layers).to(target.model.device)
    # a checkpoint resumes only the training it was saved by: the same data, vocabulary and schedule
    run_key = stage_key(print_, train_prompts, s.context_prompts, s.max_new, s.feature_layers, ids.tolist(), s.steps,
                        s.batch, s.seq_len, s.lr, s.seed, s.tts_steps, s.train_minutes)
    stats = train.train(head, samples, steps=s.steps, seq_len=s.seq_len, batch=s.batch, lr=s.lr, seed=s.seed,
                        checkpoint=s.work / f"checkpoint-{run_key}.pt", log=log, tts_steps=s.tts_steps,
                        time_budget_s=s.train_minutes * 60 if s.train_minutes else None)
    card = {
        "target": Path(target.source).name, "target_fingerprint": print_,
        "architecture": {"kind": "eagle", "decoder_layers": 1, "feature_layers": list(s.feature_layers),
                         "hidden_size": target.model.cfg.hidden_size, "draft_vocab": int(ids.numel()),
                         "initialised_from_target_layer": target.model.cfg.num_layers - 1},
        "feature_layers": list(s.feature_layers),
        "data": {**info, "samples": len(samples), "answer_tokens": sum(x.answer_len for x in samples),
                 "positions": sum(x.states.shape[0] for x in samples),
                 "vocab_coverage_of_held_out_answers": round(covered, 4)},
        "training": {"steps": stats["steps"], "batch": s.batch, "seq_len": s.seq_len, "lr": s.lr, "seed": s.seed,
                     "training_time_test_steps": s.tts_steps, "train_s": stats["train_s"],
                     "positions_seen": stats["positions_seen"]},
        "command": command(s, str(target.model.device)),
        "created": time.strftime("%Y-%m-%d"),
    }
    save_draft(s.out, head.export(), ids, card)
    card["validation"] = validate(head, valid, target, s, s.out)
    card["total_minutes"] = round((time.monotonic() - t_start) / 60, 1)
    save_draft(s.out, head.export(), ids, card)
    log(f"wrote {s.out}: {json.dumps(card['validation'])}")
    return card
