"""Engine benchmark: every mode against plain decoding (and, greedy, against
Hugging Face `generate` with and without prompt lookup) on Spec-Bench dev
prompts, per category and temperature, in one run.

Modes: `plain`; `DRAFT:G`, the draft with the engine adapting per round up to
G tokens (engines/budget.py); `DRAFT:G/fixed`, the draft verifying exactly G
every round. Per cell: speed over plain, acceptance per drafted token, mean
accepted length (tokens per target forward), and for model drafts the draft's
cost per drafted token as a fraction of a plain decode step.

Every figure is a ratio measured in the same run, the modes interleaved per
prompt, because these machines are shared and their absolute speed drifts.
Greedy outputs of every mode are compared with plain's: any difference is
reported (lossless decoding makes it empty). So are sampled outputs of the
prompt-lookup modes: with the target's draws fixed by position
(engines/sampling.py: Draws) they write plain's text too; and under coupled
sampling (a config with `coupled_sampling: true`) every mode's.

Sampled (without coupled sampling), a model draft's mode writes its own text, so a few prompts per category compare
texts as much as modes: `--samples N` runs each prompt N times per mode with
N seeds, and the adaptive mode against the draft's best fixed γ in hindsight
gets a 95% interval from a bootstrap over prompts (each prompt's every mode and
sample drawn together, the best fixed γ chosen afresh in each draw, so the
interval carries the luck of that choice too). Where a category's prompts differ
in their best fixed γ (over their samples), no fixed γ serves them all and the
adaptive mode should beat the category's best one: judged against 1.0 on the
same interval. `--speed decode` counts each run's tokens after the first over its
time after the first token: no mode speeds the prefill, and a sampled answer that
ends after a few tokens would otherwise read as a slowdown of the mode that wrote it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from bench import cpu_model, default_data_path
from bench.hindsight import SPEEDS, differing_line, hindsight, hindsight_line, over_plain, over_plain_line
from engines.api import ChatMessage, GenerationRequest, SamplingParams
from engines.arms import Arm
from engines.builtin import BuiltinEngine, drive_from_side_thread
from engines.config import load_engine_config
from engines.profile import wait_for
from engines.text import encode_prompt

DEFAULT_MODES = ("plain", "ngram:8", "ngram:2/fixed", "ngram:4/fixed", "ngram:8/fixed", "eagle:6", "eagle:1/fixed",
                 "eagle:2/fixed", "eagle:3/fixed", "eagle:4/fixed", "ngram-eagle:8", "selfspec:2/fixed")
DEFAULT_HF_PLD = (4, 10)


def parse_mode(mode: str) -> tuple[Arm, bool]:
    """'ngram:8' -> (Arm(ngram, 8), adaptive); 'ngram:8/fixed' -> (.., fixed)."""
    arm, _, fixed = mode.partition("/")
    if fixed not in ("", "fixed"):
        raise ValueError(f"mode {mode!r}: expected DRAFT:G or DRAFT:G/fixed")
    return Arm.parse(arm), fixed == "fixed"


def modes_error(modes: list[str]) -> str | None:
    """What is wrong with the first mode parse_mode refuses (None: they all parse)."""
    try:
        for m in modes:
            parse_mode(m)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Cell:
    """Totals for one (temperature, category, mode)."""

    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0  # after the first (bench/hindsight.py: SPEEDS)
    decode_s: float = 0.0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_s: float = 0.0
    runs: list[dict] = field(default_factory=list)

    def merge(self, other: Cell) -> None:
        """Adds another cell's totals (not its runs): a row over several categories."""
        for f in fields(self):
            if f.name != "runs":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def add(self, s=None, **extra) -> None:
        if s is not None:
            decode_tokens, decode_s = max(s.output_tokens - 1, 0), max(s.total_s - s.prefill_s, 0.0)
            self.tokens += s.output_tokens
            self.seconds += s.total_s
            self.decode_tokens += decode_tokens
            self.decode_s += decode_s
            self.drafted += s.drafted
            self.verified += sum(s.verified_per_round)
            self.accepted += s.accepted
            self.rounds += s.rounds
            self.draft_s += s.draft_s
            self.runs.append(dict(tokens=s.output_tokens, seconds=s.total_s, decode_tokens=decode_tokens,
                                  decode_s=decode_s, drafted=s.drafted, accepted=s.accepted, rounds=s.rounds,
                                  **extra))
        else:
            self.tokens += extra["tokens"]
            self.seconds += extra["seconds"]
            self.runs.append(extra)

    def rate(self, speed: str) -> float:
        """Tokens per second as `speed` counts them (bench/hindsight.py: SPEEDS)."""
        tokens, seconds = (getattr(self, f) for f in SPEEDS[speed])
        return tokens / seconds if seconds else 0.0


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
    model.forward(torch.randint(0, 1000, (context,), device=model.device), cache, all_logits=False)
    out: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for t in (1, 3, 5, 9):
            ids = torch.randint(0, 1000, (t,), device=model.device)
            cache.lengths[0] = context
            t0 = time.perf_counter()
            model.forward(ids, cache)
            wait_for(model.device)
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


def dev_request(row: dict, temperature: float, max_tokens: int, sample: int = 0) -> dict:
    """A dev row's first turn as GenerationRequest fields; sample k samples with its own seed."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                        seed=int(row["question_id"]) + 100_003 * sample)
    return dict(request_id=str(row["question_id"]), messages=(ChatMessage("user", row["turns"][0]),), sampling=sp)


def plains_text(engine: BuiltinEngine, mode: str) -> bool:
    """Whether a mode, sampled, writes plain's text: prompt lookup's (a one-hot q), and under
    coupled sampling every draft's."""
    arm, _ = parse_mode(mode)
    return arm.draft is not None and (engine.config.coupled_sampling
                                      or engine.arms().kind_of(arm.draft).kind == "ngram")


def rotated(modes: list[str], n: int) -> list[str]:
    """The modes starting at the n-th: rotated per run, so that drift hits every mode alike."""
    return [modes[(i + n) % len(modes)] for i in range(len(modes))]


def run_bench(engine: BuiltinEngine, rows: list[dict], modes: list[str], temperatures: list[float], max_tokens: int,
              hf_pld: tuple[int, ...] | None, log=print, samples: int = 1, speed: str = "request") -> dict:
    hf = hf_generate_runner(engine) if hf_pld is not None else None
    cells: dict[tuple[float, str, str], Cell] = defaultdict(Cell)
    mismatches = []
    total = len(rows) * sum(samples * len(modes) + (1 + len(hf_pld) if hf and t == 0 else 0) for t in temperatures)
    done, t_start = 0, time.perf_counter()
    for row in rows:
        cat, qid = row["category"], str(row["question_id"])
        for temp in temperatures:
            for k in range(samples):
                req = dev_request(row, temp, max_tokens, k)
                outputs = {}
                for mode in rotated(modes, done):
                    arm, fixed = parse_mode(mode)
                    res = engine.generate(GenerationRequest(arm=arm, fixed_gamma=fixed, **req))
                    s = res.stats
                    cells[(temp, cat, mode)].add(s, prompt_tokens=s.prompt_tokens, prompt=qid, sample=k)
                    outputs[mode] = res.token_ids
                    done += 1
                    log(f"[{done}/{total}] {time.perf_counter() - t_start:6.0f}s T={temp:g} {cat:<14} {mode:<16} "
                        f"{s.tokens_per_s:6.1f} tok/s  acc {s.acceptance_rate:.2f}  mal {s.mean_accepted_length:.2f}")
                if "plain" in outputs:  # greedy every mode, sampled those that write plain's text
                    mismatches += [(qid, f"{m}@T={temp:g}") for m, ids in outputs.items() if ids != outputs["plain"]
                                   and (temp == 0 or plains_text(engine, m))]
            if hf and temp == 0:
                prompt_ids = encode_prompt(engine.tokenizer, GenerationRequest(**req))
                for pld in (None, *hf_pld):
                    name = "hf" if pld is None else f"hf-pld:{pld}"
                    out, secs = hf(prompt_ids, max_tokens, pld)
                    cells[(temp, cat, name)].add(tokens=len(out), seconds=secs, prompt=qid, sample=0)
                    done += 1
                    log(f"[{done}/{total}] {time.perf_counter() - t_start:6.0f}s T=0 {cat:<14} {name:<16} "
                        f"{len(out) / secs:6.1f} tok/s")
    if hf:
        hf.close()
    return summarize(cells, mismatches, modes, temperatures, hf_pld if hf else None, speed)


def _row(cells: dict, temp: float, cats: list[str], names: list[str], speed: str = "request") -> dict:
    plain = Cell()
    for c in cats:
        x = cells.get((temp, c, "plain"))
        if x:
            plain.merge(x)
    step = plain.decode_s / max(plain.decode_tokens, 1)  # seconds per plain decode step
    plain_rate = plain.rate(speed)
    row = {}
    for name in names:
        cell = Cell()
        for c in cats:
            x = cells.get((temp, c, name))
            if x is not None:
                cell.merge(x)
        if not cell.seconds:
            continue
        rate = cell.rate(speed)
        row[name] = dict(
            tok_s=rate, vs_plain=rate / plain_rate if plain_rate else None,
            acceptance=cell.accepted / cell.drafted if cell.drafted else None,
            mean_accepted_length=(cell.accepted + cell.rounds) / cell.rounds if cell.rounds and cell.drafted else None,
            draft_cost=(cell.draft_s / cell.drafted) / step if cell.drafted and step else None,
            drafted=cell.drafted, verified=cell.verified, accepted=cell.accepted)
    return row


def summarize(cells, mismatches, modes, temperatures, hf_pld, speed: str = "request") -> dict:
    """hf_pld: None without the Hugging Face baseline; else its prompt-lookup settings (maybe none)."""
    cats = sorted({c for _, c, _ in cells})
    names = list(modes) + (["hf"] + [f"hf-pld:{p}" for p in hf_pld] if hf_pld is not None else [])
    tables = {}
    for temp in temperatures:
        tables[f"{temp:g}"] = {cat: _row(cells, temp, [cat], names, speed) for cat in cats}
        tables[f"{temp:g}"]["ALL"] = _row(cells, temp, cats, names, speed)
    return dict(tables=tables, mismatches=mismatches,
                runs={f"{t:g}|{c}|{n}": cells[(t, c, n)].runs for t, c, n in cells})


def format_table(table: dict, modes: list[str]) -> str:
    spec = [m for m in modes if m != "plain"]
    hf = [n for n in next(iter(table.values())) if n.startswith("hf")]
    head = ["category", "plain tok/s"] + [f"{m} x (acc/len)" for m in spec] + ["best mode"] + \
        ([f"{n} x" for n in hf] if hf else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat, row in table.items():
        if "plain" not in row:
            continue
        have = [m for m in spec if m in row]
        best = max(have, key=lambda m: row[m]["vs_plain"]) if have else "plain"
        cells = [cat, f"{row['plain']['tok_s']:.1f}"]
        for m in spec:
            v = row.get(m)
            if v is None:
                cells.append("")
            elif v["acceptance"] is None:
                cells.append(f"{v['vs_plain']:.2f}")
            else:
                cells.append(f"{v['vs_plain']:.2f} ({v['acceptance']:.2f}/{v['mean_accepted_length']:.2f})")
        cells.append(f"{best} {row[best]['vs_plain']:.2f}x" if have else "")
        cells += [f"{row[n]['vs_plain']:.2f}" if n in row else "" for n in hf]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args) -> int:
    config = load_engine_config(args.config)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    known = {r["category"] for r in rows}
    unknown = sorted(set(args.categories or ()) - known)
    if unknown:
        print(f"error: no prompts in {args.data} for {', '.join(unknown)} (categories: {', '.join(sorted(known))})",
              file=sys.stderr)
        return 2
    rows = pick_prompts(rows, args.per_category, args.categories)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    for m in args.modes:
        parse_mode(m)
    if args.samples < 1:
        print("error: --samples must be at least 1", file=sys.stderr)
        return 2
    if args.speed == "decode" and not args.no_hf:
        print("error: --speed decode times each run after its first token, which HF generate does not report: "
              "add --no-hf", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(config.target.device) if config.target.device.startswith("cuda") else None
    machine = cpu_model() + (f"; {gpu}" if gpu else "")
    log(f"machine: {machine}; torch {torch.__version__}")
    log(f"engine config: {config.model_dump_json()}")
    # The decode loop runs on this (main) thread, as in `specgate serve`; the
    # benchmark drives it from a second thread (see engines/builtin.py for why).
    engine = BuiltinEngine.from_config(config, start_worker=False)
    cost = verify_cost(engine)
    log("target forward, median: " + ", ".join(f"T={t}: {s * 1e3:.1f} ms" for t, s in cost.items()))
    summary = drive_from_side_thread(engine, lambda: run_bench(
        engine, rows, args.modes, args.temperatures, args.max_tokens,
        None if args.no_hf else tuple(args.hf_pld), log, args.samples, args.speed))
    summary["verify_cost_s"] = cost
    summary["verify8_over_step"] = cost[9] / cost[1]
    summary["coupled_sampling"] = config.coupled_sampling
    summary["settings"] = dict(max_tokens=args.max_tokens, per_category=args.per_category, samples=args.samples,
                               modes=args.modes, speed=args.speed,
                               temperatures=args.temperatures, dtype=config.target.dtype, cpu=cpu_model(), gpu=gpu,
                               profile=engine.profile.describe() if engine.profile else None)
    print(f"machine: {machine}; start-up profile: {summary['settings']['profile']}")
    speed = "" if args.speed == "request" else ", decode phase (after the first token)"
    adaptive_modes = {m: arm.draft for m, (arm, fixed) in ((m, parse_mode(m)) for m in args.modes)
                      if not arm.is_plain and not fixed}  # mode -> its draft
    for t, table in summary["tables"].items():
        print(f"\n### T={t}: speed over plain{speed} (acceptance per drafted token / mean accepted length)\n")
        print(format_table(table, args.modes))
        for adaptive, draft in adaptive_modes.items():  # against its draft's fixed γ, where the run has some
            h = hindsight(table, summary["runs"], t, draft, adaptive, args.speed)
            if h:
                summary.setdefault("hindsight", {})[f"{t}|{adaptive}"] = h
                print(hindsight_line(adaptive, draft, h))
                print(differing_line(adaptive, {c: v for c, v in h.items() if c != "ALL"}))
        for mode in adaptive_modes:
            ratios = over_plain(table, summary["runs"], t, mode, args.speed)
            if ratios:
                summary.setdefault("over_plain", {})[f"{t}|{mode}"] = ratios
                print(over_plain_line(mode, ratios))
        costs = {m: v["draft_cost"] for m, v in table["ALL"].items() if v.get("draft_cost") is not None
                 and not m.startswith("ngram")}
        if costs:
            print("draft cost per drafted token, in plain steps: " + ", ".join(f"{m} {c:.3f}" for m, c in
                                                                               costs.items()))
    print(f"\nverify 8 drafts (T=9) / one decode step (T=1): {summary['verify8_over_step']:.2f}x "
          f"({cost[9] * 1e3:.1f} ms / {cost[1] * 1e3:.1f} ms)")
    all_row = summary["tables"]["0"]["ALL"] if "0" in summary["tables"] else {}
    if "hf" in all_row:
        print(f"plain vs HF generate (all prompts, greedy): {all_row['plain']['tok_s'] / all_row['hf']['tok_s']:.2f}x")
    sampled = "every mode's" if summary.get("coupled_sampling") else "prompt lookup's"
    print(f"outputs differing from plain (greedy: every mode; sampled: {sampled}): "
          f"{len(summary['mismatches'])} {summary['mismatches']}")
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
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--samples", type=int, default=1,
                   help="runs of each prompt per mode and temperature, with as many seeds (default: %(default)s)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7], help="(default: %(default)s)")
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                   help="plain, DRAFT:G (adaptive up to G) or DRAFT:G/fixed (default: %(default)s)")
    p.add_argument("--hf-pld", nargs="*", type=int, default=list(DEFAULT_HF_PLD),
                   help="HF prompt_lookup_num_tokens values to compare, greedy only (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baselines")
    p.add_argument("--speed", choices=tuple(SPEEDS), default="request",
                   help="tokens per second of each run's whole time, or of its decode phase (tokens after the first "
                        "over the time after it: what a mode changes, where sampled answers of different lengths "
                        "carry their prompt's prefill unevenly; needs --no-hf) (default: %(default)s)")
    p.add_argument("--out", help="write every measurement as JSON here")
