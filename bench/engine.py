"""Engine benchmark: every arm against plain decoding and against Hugging Face
`generate` (plain and prompt lookup), on Spec-Bench dev prompts, in one run.

Every figure is a ratio measured in the same run, with the arms interleaved per
prompt, because these machines are shared and their absolute speed drifts.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import cpu_model, default_data_path
from engines.api import ChatMessage, GenerationRequest, SamplingParams
from engines.arms import Arm
from engines.builtin import BuiltinEngine, drive_from_side_thread
from engines.config import load_engine_config
from engines.text import encode_prompt

DEFAULT_ARMS = ("plain", "ngram:2", "ngram:4", "ngram:8", "selfspec:2", "selfspec:4")
DEFAULT_HF_PLD = (4, 10)


@dataclass
class Cell:
    """Totals for one (category, arm)."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    runs: list[dict] = field(default_factory=list)

    def add(self, tokens: int, seconds: float, drafted: int = 0, accepted: int = 0, rounds: int = 0, **extra):
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += rounds
        self.runs.append(dict(tokens=tokens, seconds=seconds, drafted=drafted, accepted=accepted, **extra))

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pick_prompts(rows: list[dict], per_category: int, categories: list[str] | None) -> list[dict]:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    cats = categories or sorted(by_cat)
    return [r for c in cats for r in by_cat[c][:per_category]]


def verify_cost(engine: BuiltinEngine, context: int = 256, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one target forward of T tokens after `context` cached ones."""
    model = engine.model
    cache = model.new_cache(context + 16)
    model.forward(torch.randint(0, 1000, (context,)), cache, all_logits=False)
    out: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for t in (1, 3, 5, 9):
            ids = torch.randint(0, 1000, (t,))
            cache.lengths[0] = context
            t0 = time.perf_counter()
            model.forward(ids, cache)
            out[t].append(time.perf_counter() - t0)
    return {t: statistics.median(v) for t, v in out.items()}


def _hf_worker(source: str, dtype: str, conn) -> None:
    """Hugging Face generate in a process of its own (see hf_generate_runner)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).eval()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompt_ids, max_tokens, pld, pad = job
        ids = torch.tensor([prompt_ids])
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        if pld:
            kw["prompt_lookup_num_tokens"] = pld
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        conn.send((out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0))


def hf_generate_runner(engine: BuiltinEngine):
    """Hugging Face generate on the same weights and dtype as the engine's target, in a
    separate process: run in this process, its OpenMP thread pool slowed the engine's
    decode step from ~52 to ~78 ms for the rest of the run."""
    import multiprocessing as mp

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_hf_worker, args=(engine.target.source,
                                                                    engine.config.target.dtype, child), daemon=True)
    proc.start()
    if parent.recv() != "ready":
        raise RuntimeError("the Hugging Face baseline process did not start")
    pad = engine.tokenizer.eos_token_id

    def run(prompt_ids: list[int], max_tokens: int, pld: int | None) -> tuple[list[int], float]:
        parent.send((prompt_ids, max_tokens, pld, pad))
        return parent.recv()

    run.close = lambda: (parent.send(None), proc.join(10))
    return run


def run_bench(engine: BuiltinEngine, rows: list[dict], arms: list[str], max_tokens: int,
              hf_pld: tuple[int, ...] | None, log=print) -> dict:
    hf = hf_generate_runner(engine) if hf_pld is not None else None
    cells: dict[tuple[str, str], Cell] = defaultdict(Cell)
    mismatches = []
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    total = len(rows) * (len(arms) + (1 + len(hf_pld) if hf else 0))
    done = 0
    t_start = time.perf_counter()
    for row in rows:
        cat = row["category"]
        req = dict(request_id=str(row["question_id"]), messages=(ChatMessage("user", row["turns"][0]),), sampling=sp)
        reference = None
        for arm in arms:
            res = engine.generate(GenerationRequest(arm=Arm.parse(arm), **req))
            s = res.stats
            cells[(cat, arm)].add(s.output_tokens, s.total_s, s.drafted, s.accepted, s.rounds,
                                  decode_s=s.total_s - s.prefill_s, prompt_tokens=s.prompt_tokens)
            if reference is None:
                reference = res.token_ids
            elif res.token_ids != reference:
                mismatches.append((row["question_id"], arm))
            done += 1
            log(f"[{done}/{total}] {time.perf_counter() - t_start:6.0f}s {cat:<14} {arm:<12} "
                f"{s.tokens_per_s:6.1f} tok/s  acc {s.acceptance_rate:.2f}  mal {s.mean_accepted_length:.2f}")
        if hf:
            prompt_ids = encode_prompt(engine.tokenizer, GenerationRequest(**req))
            for pld in (None, *hf_pld):
                name = "hf" if pld is None else f"hf-pld:{pld}"
                out, secs = hf(prompt_ids, max_tokens, pld)
                cells[(cat, name)].add(len(out), secs)
                done += 1
                log(f"[{done}/{total}] {time.perf_counter() - t_start:6.0f}s {cat:<14} {name:<12} "
                    f"{len(out) / secs:6.1f} tok/s")
    if hf:
        hf.close()
    return summarize(cells, mismatches, arms, hf_pld if hf else ())


def summarize(cells, mismatches, arms, hf_pld) -> dict:
    cats = sorted({c for c, _ in cells})
    names = list(arms) + (["hf"] + [f"hf-pld:{p}" for p in hf_pld] if hf_pld else [])
    table = {}
    for cat in cats + ["ALL"]:
        row = {}
        for name in names:
            if cat == "ALL":
                cell = Cell()
                for c in cats:
                    x = cells[(c, name)]
                    cell.add(x.tokens, x.seconds, x.drafted, x.accepted, x.rounds)
            else:
                cell = cells[(cat, name)]
            row[name] = dict(tok_s=cell.tok_s, tokens=cell.tokens, seconds=cell.seconds,
                             acceptance=cell.accepted / cell.drafted if cell.drafted else None,
                             mean_accepted_length=(cell.accepted + cell.rounds) / cell.rounds if cell.rounds else None)
        plain = row["plain"]["tok_s"] or 1.0
        for name in names:
            row[name]["vs_plain"] = row[name]["tok_s"] / plain
        table[cat] = row
    return dict(table=table, greedy_mismatches=mismatches,
                runs={f"{c}|{n}": cells[(c, n)].runs for c, n in cells})


def format_table(summary: dict, arms: list[str]) -> str:
    table = summary["table"]
    names = [n for n in next(iter(table.values()))]
    spec = [a for a in arms if a != "plain"]
    hf_pld = [n for n in names if n.startswith("hf-pld")]
    head = (["category", "plain tok/s"] + [f"{a} x" for a in spec] + ["best arm", "HF tok/s"]
            + [f"{n} x" for n in hf_pld])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat, row in table.items():
        best = max(spec, key=lambda a: row[a]["vs_plain"]) if spec else "plain"
        cells = [cat, f"{row['plain']['tok_s']:.1f}"]
        for a in spec:
            acc = row[a]["acceptance"]
            cells.append(f"{row[a]['vs_plain']:.2f} ({acc:.2f})" if acc is not None else f"{row[a]['vs_plain']:.2f}")
        cells.append(f"{best} {row[best]['vs_plain']:.2f}x")
        if "hf" in row:
            cells.append(f"{row['hf']['tok_s']:.1f}")
            cells += [f"{row[n]['vs_plain']:.2f}" for n in hf_pld]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args) -> int:
    config = load_engine_config(args.config)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows = pick_prompts(rows, args.per_category, args.categories)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"machine: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    log(f"engine config: {config.model_dump_json()}")
    # The decode loop runs on this (main) thread, as in `specgate serve`; the
    # benchmark drives it from a second thread (see engines/builtin.py for why).
    engine = BuiltinEngine.from_config(config, start_worker=False)
    cost = verify_cost(engine)
    log("target forward, median: " + ", ".join(f"T={t}: {s * 1e3:.1f} ms" for t, s in cost.items()))
    summary = drive_from_side_thread(engine, lambda: run_bench(
        engine, rows, args.arms, args.max_tokens, None if args.no_hf else tuple(args.hf_pld), log))
    summary["verify_cost_s"] = cost
    summary["verify8_over_step"] = cost[9] / cost[1]
    summary["settings"] = dict(max_tokens=args.max_tokens, per_category=args.per_category, arms=args.arms,
                               dtype=config.target.dtype, threads=torch.get_num_threads(), cpu=cpu_model())
    print(f"machine: {cpu_model()}")
    print(format_table(summary, args.arms))
    print(f"\nverify 8 drafts (T=9) / one decode step (T=1): {summary['verify8_over_step']:.2f}x "
          f"({cost[9] * 1e3:.1f} ms / {cost[1] * 1e3:.1f} ms)")
    all_row = summary["table"]["ALL"]
    if "hf" in all_row:
        print(f"plain vs HF generate (all prompts): {all_row['plain']['tok_s'] / all_row['hf']['tok_s']:.2f}x")
    print(f"greedy outputs differing from plain: {len(summary['greedy_mismatches'])} {summary['greedy_mismatches']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    p.add_argument("--config", help="engine config YAML (default: built-in SmolLM2 config)")
    p.add_argument("--per-category", type=int, default=1, help="prompts per category (default: %(default)s)")
    p.add_argument("--categories", nargs="*", help="only these categories")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help="arms; the first must be plain")
    p.add_argument("--hf-pld", nargs="*", type=int, default=list(DEFAULT_HF_PLD),
                   help="HF prompt_lookup_num_tokens values to compare (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baselines")
    p.add_argument("--out", help="write every measurement as JSON here")
