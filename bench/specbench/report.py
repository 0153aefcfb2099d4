"""The bench's Markdown report and PNG plots, from its summary dict."""

from __future__ import annotations

from pathlib import Path

from bench.specbench.workload import ADAPTIVE


def _f(v, spec=".2f", suffix="") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def prices_markdown(engines: list[dict]) -> list[str]:
    """What each engine priced work at by the end of the run, in its own decode steps."""
    lines = []
    for e in engines:
        lone = e.get("lone_step_s") or []
        if not lone:
            continue
        verify = ", ".join(f"{k}: {lone[k] / lone[0] - 1:+.2f}" for k in range(1, len(lone)))
        drafting = "; ".join(f"drafting {d} {v * 1e3:.2f} ms per token ({v / lone[0]:.3f} of a step)"
                             for d, v in e.get("drafting_s", {}).items())
        lines.append(f"Engine `{e['id']}` prices (end of run): a decode step {lone[0] * 1e3:.1f} ms; a lone row "
                     f"verifying k drafts, over a step: {verify}{'; ' + drafting if drafting else ''}.")
    return lines + [""] if lines else []


def markdown(summary: dict) -> str:
    s = summary["settings"]
    reps = s["repeats"]  # per level (older runs: one count for every level)
    passes = ", ".join(f"{n} at c={c}" for c, n in reps.items()) if isinstance(reps, dict) else reps
    lines = [
        "# specgate bench", "",
        f"Workload: {s['requests']} requests from `{s['data']}` ({s['per_category']} per category"
        f"{f' after the first {n}' if (n := s.get('skip')) else ''}), "
        f"temperatures {s['temperatures']}, max_tokens {s['max_tokens']}, passes {passes}, seed {s['seed']}; "
        f"gateway {s['gateway']}; machine {s.get('cpu', 'not recorded')}.", "",
        *prices_markdown(s.get("engines") or []),
        "Speed is output tokens per second of request time, so arms that sample answers of different "
        "lengths at temperature > 0 compare fairly; at temperature 0 it equals the ratio of total times.", "",
        "## Targets", "", "Each judged on its 95% interval: met when the interval's lower end clears the target, "
        "missed when its upper end falls short, undecided in between.", "",
        "| target | measured [95% interval] | verdict |", "|---|---|---|",
    ]
    for t in summary["targets"]:
        m = t["measured"]
        shown = f"{_f(m[0], 'g')} [{_f(m[1], '.3f')}, {_f(m[2], '.3f')}]" if m[1] == m[1] else _f(m[0], "g")
        lines.append(f"| {t['target']} | {shown} | {t['verdict']} |")
    mism = summary["greedy_mismatches"]
    lines += ["", f"Temperature-0 outputs identical across modes: "
              f"{'yes' if not mism else f'**NO** ({len(mism)} requests differ)'}"]
    sampled = summary.get("sampled_lookup")
    if sampled and sampled["compared"]:
        bad = len(sampled["mismatches"])
        lines += ["", f"Sampled outputs served plain or by {sampled.get('drafts', 'prompt lookup')} (adaptive "
                  "included) identical: "
                  f"{'yes' if not bad else f'**NO** ({bad} requests differ)'}, {sampled['compared']} requests "
                  "compared"]
    lines.append("")
    iv = summary.get("intervals") or {}
    if any(iv.values()):
        lines += ["## Ratios with 95% intervals", ""]
        if iv.get("c1 decode"):
            lines += ["Level `c1 decode`: the same ratios over each request's time after its first token (what "
                      "decoding changes; the targets are judged on request speed).", ""]
        lines += ["| level | ratio | point | low | high |", "|---|---|---|---|---|"]
        for level, table in iv.items():
            for k, (p, lo, hi) in sorted(table.items()):
                lines.append(f"| {level} | {k} | {p:.3f} | {_f(lo, '.3f')} | {_f(hi, '.3f')} |")
        lines.append("")
    c1 = summary.get("concurrency_1")
    if c1:
        lines += ["## Concurrency 1 (modes interleaved per request)", "",
                  "| mode | requests | tokens | time s | tok/s | vs plain | p50 s | p99 s |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, t in c1["modes"].items():
            lines.append(f"| {mode} | {t['requests']} | {t['tokens']} | {t['seconds']:.1f} | {t['tok_s']:.2f} | "
                         f"{_f(t['vs_plain'])}x | {t['p50_s']:.2f} | {t['p99_s']:.2f} |")
        lines += ["", f"Best fixed arm: {c1.get('best_fixed')}; adaptive vs it: "
                  f"{_f(c1.get('adaptive_vs_best_fixed'))}x; adaptive vs oracle: {_f(c1.get('adaptive_vs_oracle'))}x"
                  + (f", vs the oracle with its arms chosen on other passes: {_f(ho)}x (the true per-request best lies "
                     "between the two)" if (ho := c1.get("adaptive_vs_held_out_oracle")) else "") + ".",
                  f"Oracle's picks: {c1['oracle_arms']}.", f"Adaptive's picks: {c1.get('adaptive_arms', {})}."]
        if noise := c1.get("timing_noise"):
            lines.append(f"Timing noise: {noise['pairs']} greedy requests served by adaptive with a fixed mode's arm "
                         f"and text differ from that mode's time by {noise['sd_log_ratio']:.3f} (sd of the log "
                         f"ratio; decode phase {_f(noise['decode_sd_log_ratio'], '.3f')}).")
        lines.append("")
        cats = summary["by_category"]
        modes = [m for m in c1["modes"] if m != "plain"]
        lines += ["### Speed over plain by category (concurrency 1)", "",
                  "| category | " + " | ".join(modes) + " | adaptive's arms |",
                  "|---|" + "---|" * (len(modes) + 1)]
        for cat, row in cats.items():
            cells = [f"{_f(row['modes'][m]['vs_plain'])}" if m in row["modes"] else "" for m in modes]
            lines.append(f"| {cat} | " + " | ".join(cells) + f" | {row.get('adaptive_arms', {})} |")
        lines += ["", "### By temperature (concurrency 1)", "", "| temperature | best fixed | adaptive vs it | "
                  "adaptive vs oracle |", "|---|---|---|---|"]
        for t, row in summary["by_temperature"].items():
            lines.append(f"| {t} | {row.get('best_fixed')} | {_f(row.get('adaptive_vs_best_fixed'))}x | "
                         f"{_f(row.get('adaptive_vs_oracle'))}x |")
        lines.append("")
    conc = summary["concurrency"]
    if conc:
        lines += ["## Throughput against concurrency", "", "| concurrency | mode | tok/s | vs plain | p99 s |",
                  "|---|---|---|---|---|"]
        for c, row in conc.items():
            for mode, t in row.items():
                lines.append(f"| {c} | {mode} | {t['tok_s']:.2f} | {_f(t['vs_plain'])}x | {t['p99_s']:.2f} |")
        lines.append("")
    curve = summary.get("learning_curve")
    if curve and curve.get("served"):
        lines += ["## Learning curve (cold start, retraining live)", "",
                  f"Rolling window {curve['window']} requests. Reached 0.9x oracle at request "
                  f"{_f(curve['reached_0_9_at'], 'd')}; final {_f(curve['final_vs_oracle'])}x oracle, "
                  f"{_f(curve['final_vs_plain'])}x plain; policy versions served: "
                  f"{len(set(v for v in curve['policy_versions'] if v))}.", ""]
    if summary.get("plots"):
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in summary["plots"]] + [""]
    return "\n".join(lines)


def plots(summary: dict, out_dir: Path) -> list[str]:
    """PNG files written (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    cats = summary.get("by_category") or {}
    if cats:
        modes = [m for m in summary["concurrency_1"]["modes"] if m != "plain"]
        fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.2))
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            ys = [row["modes"].get(mode, {}).get("vs_plain") or 0 for row in cats.values()]
            ax.bar([i + j * width for i in range(len(cats))], ys, width, label=mode)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], list(cats), rotation=30, ha="right")
        ax.set_ylabel("speed over plain (tok/s ratio)")
        ax.set_title("Speed over plain by category, concurrency 1")
        ax.legend(fontsize=7, ncol=3)
        save(fig, "speedup_by_category.png")

    conc = summary.get("concurrency") or {}
    if conc:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        levels = sorted(int(c) for c in conc)
        modes = sorted({m for row in conc.values() for m in row}, key=lambda m: (m != "plain", m == ADAPTIVE, m))
        for mode in modes:
            xs = [c for c in levels if mode in conc[str(c)]]
            a1.plot(xs, [conc[str(c)][mode]["tok_s"] for c in xs], marker="o", label=mode)
            a2.plot(xs, [conc[str(c)][mode]["p99_s"] for c in xs], marker="o", label=mode)
        for ax, label in ((a1, "throughput (output tok/s)"), (a2, "p99 latency (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        a1.legend(fontsize=7)
        save(fig, "concurrency.png")

    acc = summary.get("acceptance") or {}
    if acc:
        fig, axes = plt.subplots(1, len(acc), figsize=(6 * len(acc), 4), squeeze=False)
        for ax, (draft, by_cat) in zip(axes[0], acc.items()):
            temps = sorted({t for v in by_cat.values() for t in v}, key=float)
            width = 0.8 / max(len(temps), 1)
            for j, t in enumerate(temps):
                ax.bar([i + j * width for i in range(len(by_cat))], [v.get(t, 0) for v in by_cat.values()], width,
                       label=f"T={t}")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(by_cat))], list(by_cat), rotation=30, ha="right")
            ax.set_ylabel("accepted / drafted")
            ax.set_title(f"{draft}: acceptance by category and temperature")
            ax.legend(fontsize=7)
        save(fig, "acceptance.png")

    curve = summary.get("learning_curve")
    if curve and curve.get("served"):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(curve["served"], curve["vs_oracle"], label="adaptive / oracle")
        ax.plot(curve["served"], curve["vs_plain"], label="adaptive / plain")
        ax.axhline(0.9, color="grey", ls="--", lw=0.8, label="0.9x oracle")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xlabel("requests served since cold start")
        ax.set_ylabel(f"rolling speed ratio (window {curve['window']})")
        ax.set_title("Learning curve")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "learning_curve.png")
    return written
