"""Load benchmark: output tokens/s and per-request latency (p50/p99) of every
mode at concurrency 1..32 on the built-in engine with continuous batching,
closed loop (each client sends its next request when the previous one ends).

Shows where speculation stops paying with a fixed γ (at low load a step is
bound by reading the weights and verifying a few extra tokens is nearly free;
at high load the batch already saturates compute and verification competes for
it), and what the engine's per-step verification budget makes of the same
drafts: modes are `plain`, `DRAFT:G` (adaptive up to G) and `DRAFT:G/fixed`;
`MODE@S` runs a mode with the engine's `max_step_stretch` at S (others'
speculation may make a request at most that share slower than plain; `@none`:
unbounded), so the latency bound is compared with the unbounded budget in the
same run.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

from bench import cpu_model
from bench.engine import parse_mode
from bench.specbench.intervals import repeats_interval, verdict
from engines.api import ChatMessage, GenerationRequest, SamplingParams
from engines.builtin import BuiltinEngine, drive_from_side_thread
from engines.config import load_engine_config

DEFAULT_ARMS = ("plain", "ngram:8/fixed", "ngram:8", "eagle:4/fixed", "eagle:6", "ngram-eagle:8", "selfspec:2/fixed",
                "selfspec:2")
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
TARGET = 0.98  # every speculative arm at least this share of plain's throughput, at every level


def load_prompts(path: Path, engine: BuiltinEngine, max_prompt_tokens: int,
                 per_category: int = 3) -> list[tuple[ChatMessage, ...]]:
    """The first `per_category` prompts of each category (those the trained draft
    never saw: `specgate distill` holds them out), up to a prompt length."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] > per_category:
            continue
        msgs = (ChatMessage("user", r["turns"][0]),)
        if engine.count_tokens(r["turns"][0]) <= max_prompt_tokens:
            out.append(msgs)
    return out


def stretch_of(mode: str, default: float | None) -> float | None:
    """`ngram:8@0.05`: the mode with the engine's max_step_stretch at 0.05, `@none`
    unbounded (its config's without `@`)."""
    if "@" not in mode:
        return default
    bound = mode.split("@")[1]
    return None if bound == "none" else float(bound)


def run_level(engine: BuiltinEngine, prompts, arm: str, concurrency: int, per_client: int,
              max_tokens: int, offset: int) -> dict:
    lat, tokens, errors = [], [], []
    spent = dict(drafted=0, verified=0, accepted=0)  # draft tokens over the level's requests: why an arm ran as it did
    slots: dict[str, list] = {}  # "client-j" (the same prompt for every arm in a repeat) -> [latency, accepted]
    lock = threading.Lock()

    def client(c: int):
        for j in range(per_client):
            msgs = prompts[(offset + c * per_client + j) % len(prompts)]
            t0 = time.perf_counter()
            try:
                a, fixed = parse_mode(arm.split("@")[0])
                sp = SamplingParams(max_tokens=max_tokens)
                res = engine.generate(GenerationRequest(request_id=f"{c}-{j}", messages=msgs, arm=a, fixed_gamma=fixed,
                                                        sampling=sp))
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                errors.append(repr(e))
                continue
            with lock:
                lat.append(time.perf_counter() - t0)
                tokens.append(res.stats.output_tokens)
                slots[f"{c}-{j}"] = [lat[-1], res.stats.accepted]
                spent["drafted"] += res.stats.drafted
                spent["verified"] += sum(res.stats.verified_per_round)
                spent["accepted"] += res.stats.accepted

    engine.set_max_step_stretch(stretch_of(arm, engine.config.max_step_stretch))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return dict(arm=arm, concurrency=concurrency, requests=len(lat), tokens=sum(tokens), wall_s=wall,
                tok_s=sum(tokens) / wall, p50_s=statistics.median(lat) if lat else None,
                p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None, errors=errors, slots=slots,
                **spent)


def summarise(results: list[dict], arms: list[str], levels: list[int]) -> dict:
    """Per level and arm: mean tok/s, mean p99, and the throughput and p99 ratios
    to the first arm as [mean, low, high] over repeats (each repeat's ratio paired
    in time); and `bystanders`: over the requests none of whose drafts were
    accepted, latency over the first arm's on the same prompt and slot in the same
    repeat, [mean, low, high] over repeats (what others' speculation cost the
    requests it did not speed up; _bystanders); and the draft tokens its requests drafted,
    verified and accepted over every repeat (None from runs recorded without them)."""
    out: dict = {}
    for c in levels:
        runs = [r for r in results if r["concurrency"] == c]
        base = {r["repeat"]: r for r in runs if r["arm"] == arms[0]}
        out[c] = {}
        for a in arms:
            mine = [r for r in runs if r["arm"] == a]
            out[c][a] = dict(tok_s=statistics.mean(r["tok_s"] for r in mine),
                             p99_s=statistics.mean(r["p99_s"] for r in mine if r["p99_s"] is not None),
                             ratio=_paired(mine, base, "tok_s"), p99_ratio=_paired(mine, base, "p99_s"),
                             bystanders=_bystanders(mine, base),
                             **{k: sum(r[k] for r in mine) if all(k in r for r in mine) else None
                                for k in ("drafted", "verified", "accepted")})
    return out


def _paired(mine: list[dict], base: dict[int, dict], key: str) -> list[float]:
    """An arm's `key` over the first arm's in the same repeat, as an interval over repeats."""
    ratios = [r[key] / base[r["repeat"]][key] for r in mine
              if r["repeat"] in base and r[key] and base[r["repeat"]][key]]
    return repeats_interval(ratios) if ratios else [float("nan")] * 3


def _bystanders(mine: list[dict], base: dict[int, dict]) -> list[float]:
    """Per repeat, the mean latency ratio of its requests that accepted nothing to the
    first arm's on the same slot; the interval is over repeats. The requests of one
    repeat share its spell of the machine, so they are not independent draws: an
    interval over requests read 1.03 [1.02, 1.03] where the repeats' own means ranged
    0.85-1.19."""
    means = []
    for r in mine:
        theirs = base.get(r["repeat"], {}).get("slots", {})
        ratios = [lat / theirs[k][0] for k, (lat, accepted) in r.get("slots", {}).items()
                  if accepted == 0 and k in theirs]
        if ratios:
            means.append(sum(ratios) / len(ratios))
    return repeats_interval(means) if means else [float("nan")] * 3


def _interval(iv: list[float]) -> str:
    point, low, high = iv
    return f"{point:.2f}" if math.isnan(low) else f"{point:.2f} [{low:.2f}, {high:.2f}]"


def plot(summary: dict, out: Path, arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = sorted(summary)
    for arm in arms:
        a1.plot(xs, [summary[c][arm]["tok_s"] for c in xs], marker="o", label=arm)
        a2.plot(xs, [summary[c][arm]["p99_s"] for c in xs], marker="o", label=arm)
    for ax, title in ((a1, "output tokens/s"), (a2, "p99 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a1.legend()
    fig.suptitle("SmolLM2-135M, 2-core CPU, continuous batching")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def reread(path: Path) -> int:
    """A past run's summary again, from its JSON, by this version's arithmetic."""
    try:
        run = json.loads(path.read_text())
        results = run["results"]
        arms = list(dict.fromkeys(r["arm"] for r in results))
        levels = sorted({r["concurrency"] for r in results})
        repeats = 1 + max(r["repeat"] for r in results)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {path}: not a bench-load run ({e})", file=sys.stderr)
        return 2
    # the baseline first, as it ran (a run's first arm rotates per repeat; repeat 0 starts with it)
    first = [r["arm"] for r in results if r["repeat"] == 0 and r["concurrency"] == levels[0]][0]
    arms.remove(first)
    report(summarise(results, [first] + arms, levels), [first] + arms, levels, repeats, run.get("machine", "?"))
    return 0


def main(args) -> int:
    if args.reread:
        return reread(Path(args.reread))
    config = load_engine_config(args.config).model_copy(update=dict(max_batch=max(args.levels),
                                                                     max_queue=4 * max(args.levels)))
    engine = BuiltinEngine.from_config(config, start_worker=False)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    prompts = load_prompts(Path(args.data), engine, args.max_prompt_tokens)
    log(f"machine: {cpu_model()}")
    log(f"{len(prompts)} prompts of <= {args.max_prompt_tokens} tokens; kv budget {config.kv_budget_tokens} positions")

    def drive():
        results = []
        for c in args.levels:
            # each client sends several: a slot freed early is refilled, as when serving; with one
            # request each, a level would time its slowest request and not throughput
            per_client = max(args.requests_per_client, -(-args.requests_per_level // c))
            for rep in range(args.repeats):
                # arms interleaved per level and rotated per repeat: drift hits them alike; each
                # repeat its own prompts, the same for every arm in it (ratios stay paired)
                k = rep % len(args.arms)
                for arm in args.arms[k:] + args.arms[:k]:
                    r = run_level(engine, prompts, arm, c, per_client, args.max_tokens, offset=c + rep * 7)
                    results.append(r | dict(repeat=rep))
                    log(f"c={c:<3} {arm:<11} {r['tok_s']:7.1f} tok/s  p50 {r['p50_s']:.2f} s  p99 {r['p99_s']:.2f} s"
                        f"  ({r['requests']} requests{', errors: ' + str(len(r['errors'])) if r['errors'] else ''})"
                        f"  repeat {rep + 1}/{args.repeats}"
                        + (f"  drafted {r['drafted']}, verified {r['verified']}, accepted {r['accepted']}"
                           if arm.split("@")[0] != "plain" else ""))
        return results

    results = drive_from_side_thread(engine, drive)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = summarise(results, args.arms, args.levels)
    report(summary, args.arms, args.levels, args.repeats, cpu_model())
    print(f"peak RSS {peak_rss_mb:.0f} MB (weights, caches and all); KV budget {config.kv_budget_tokens} positions")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(machine=cpu_model(), results=results, summary=summary,
                                                  peak_rss_mb=peak_rss_mb), indent=1))
        plot(summary, Path(args.out).with_suffix(".png"), args.arms)
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0


def report(summary: dict, arms: list[str], levels: list[int], repeats: int, machine: str) -> None:
    """The summary as printed: the table, then each arm's verdicts, tails, undrafted
    requests and draft tokens."""
    print(f"machine: {machine}")
    print(f"{repeats} repeat(s) per level; ratio: mean over repeats of tok/s over plain's in the same repeat"
          + (", [95% t interval]" if repeats > 1 else ""))
    print("| concurrency | " + " | ".join(f"{a} tok/s (x plain) / p99 s" for a in arms) + " |")
    print("|---" * (len(arms) + 1) + "|")
    for c in levels:
        cells = []
        for a in arms:
            s = summary[c][a]
            ratio = "" if a == arms[0] else f" ({_interval(s['ratio'])})"
            cells.append(f"{s['tok_s']:.1f}{ratio} / {s['p99_s']:.1f}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    for arm in arms[1:]:
        verdicts = {c: verdict(summary[c][arm]["ratio"], TARGET) for c in levels}
        print(f"{arm}: >= {TARGET}x plain at " + ", ".join(f"c={c} {v}" for c, v in verdicts.items()))
        print(f"{arm}: p99 over plain's at " + ", ".join(f"c={c} {_interval(summary[c][arm]['p99_ratio'])}"
                                                       for c in levels))
        print(f"{arm}: requests with no accepted draft, latency over plain's on the same prompt at "
              + ", ".join(f"c={c} {_interval(summary[c][arm]['bystanders'])}" for c in levels))
        if all(summary[c][arm]["drafted"] is not None for c in levels):  # runs before the counts: not recorded
            print(f"{arm}: draft tokens drafted / verified / accepted at "
                  + ", ".join(f"c={c} {summary[c][arm]['drafted']} / {summary[c][arm]['verified']} / "
                              f"{summary[c][arm]['accepted']}" for c in levels))
    base = {c: summary[c][arms[0]]["tok_s"] for c in levels}
    if 1 in base and 8 in base:
        print(f"plain throughput, concurrency 8 / 1: {base[8] / base[1]:.2f}x")


def add_arguments(p) -> None:
    from bench import default_data_path

    p.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help="modes: plain, DRAFT:G (adaptive) or DRAFT:G/fixed, each optionally @S (max_step_stretch S, "
                        "@none: unbounded); "
                        "the first is the baseline")
    p.add_argument("--config", help="engine config YAML (default: built-in SmolLM2 config)")
    p.add_argument("--levels", nargs="+", type=int, default=list(DEFAULT_LEVELS), help="concurrency levels")
    p.add_argument("--requests-per-level", type=int, default=4, help="requests per level at least (default: 4)")
    p.add_argument("--requests-per-client", type=int, default=3,
                   help="requests each client sends back to back, at least (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes per level, arms rotated and prompts varied per pass; >1 gives 95%% intervals "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=160, help="skip longer prompts (default: %(default)s)")
    p.add_argument("--out", help="JSON results; a PNG plot is written beside it")
    p.add_argument("--from", dest="reread", metavar="JSON",
                   help="run nothing: print a past run's summary again from its --out JSON")
