"""`specgate rules ...` and `specgate policy ...` subcommands."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def add_commands(sub) -> None:
    r = sub.add_parser("rules", help="validate operator rules, or explain which rule a request hits")
    rs = r.add_subparsers(dest="rules_command", required=True, metavar="ACTION")
    c = rs.add_parser("check", help="validate a rules file; exit 1 with precise errors when invalid")
    c.add_argument("file")
    c.set_defaults(func=cmd_rules_check)
    e = rs.add_parser("explain", help="show the rule a request matches, why, and the decision")
    e.add_argument("file")
    e.add_argument("--request", required=True,
                   help='JSON: {"prompt": "...", "temperature": 0, "top_p": 1, "max_tokens": 128, '
                        '"category": null, "expected_length": null, "tenant": "", "running": 0, "waiting": 0, '
                        '"arm": null}')
    e.add_argument("--arms", default="ngram,selfspec:1-8",
                   help="drafts and γ range the engines serve (default: %(default)s)")
    e.set_defaults(func=cmd_rules_explain)

    p = sub.add_parser("policy", help="train the prompt category classifier")
    ps = p.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    t = ps.add_parser("train-classifier", help="retrain the category classifier from labelled JSONL and "
                                                "report its cross-validated accuracy")
    t.add_argument("--data", nargs="+", required=True,
                   help="JSONL files: Spec-Bench rows (category, turns) or {category, text} rows; Spec-Bench "
                        "labels are mapped onto the product's categories")
    t.add_argument("--out", help="where to write the classifier JSON (default: the bundled one)")
    t.set_defaults(func=cmd_train_classifier)

    from engines.bench import default_data_path

    b = sub.add_parser("bench-policy", help="decision latency (features with classifier, plus decide)")
    b.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=20, help="passes over the prompts (default: %(default)s)")
    b.add_argument("--rules", help="rules file (default: no rules)")
    b.set_defaults(func=cmd_bench_policy)


def cmd_rules_check(args) -> int:
    from policy.rules import RulesError, load_rules

    try:
        rules = load_rules(args.file)
    except RulesError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.file}: OK, {len(rules.rules)} rules, version {rules.digest}")
    return 0


def parse_arms(spec: str):
    """'ngram,selfspec:1-8' -> ArmInfo(drafts=(ngram, selfspec), 1, 8): every draft
    at every γ in the range; 'plain,ngram:4,draft:5' -> exactly those arms (servers
    configured per arm)."""
    import re

    from engines.api import Arm, ArmInfo

    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if entries and all(re.fullmatch(r"plain|[\w.-]+:\d+", e) for e in entries):
        return ArmInfo.of([Arm()] + [Arm.parse(e) for e in entries])
    names, _, rng = spec.partition(":")
    lo, _, hi = (rng or "1-8").partition("-")
    return ArmInfo(tuple(n for n in names.split(",") if n), int(lo), int(hi or lo))


def cmd_rules_explain(args) -> int:
    from policy.classifier import CategoryClassifier
    from policy.decide import decide
    from policy.features import build_features
    from policy.model import prior_model
    from policy.rules import RulesError, load_rules

    try:
        rules = load_rules(args.file)
        req = json.loads(args.request)
        if not isinstance(req, dict):
            raise ValueError("--request must be a JSON object")
    except (RulesError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    text = req.get("prompt", "")
    model = prior_model()
    f = build_features(
        text, prompt_tokens=max(1, len(text) // 4), temperature=float(req.get("temperature", 0)),
        top_p=float(req.get("top_p", 1)), max_tokens=int(req.get("max_tokens", 128)),
        classifier=CategoryClassifier.load(), model=model, category_hint=req.get("category"),
        expected_length_hint=req.get("expected_length"), running=int(req.get("running", 0)),
        waiting=int(req.get("waiting", 0)), tenant=req.get("tenant", ""), requested_arm=req.get("arm"),
    )
    rule, _, skipped = rules.match(f)
    print(f"features: category={f.category} temperature={f.temperature:g} top_p={f.top_p:g} "
          f"prompt≈{f.prompt_tokens} tokens expected_length={f.expected_output_tokens} load={f.load} "
          f"tenant={f.tenant!r} copy_signal={f.copy_signal:.2f}")
    for s in skipped:
        print(f"  skipped {s}")
    print(f"matched: {rule.name if rule else 'default'}")
    d = decide(f, rules, model, random.Random(0), parse_arms(args.arms))
    print(f"decision: {d.arm.name} ({d.source}) — {d.reason}")
    return 0


def cmd_train_classifier(args) -> int:
    from policy.classifier import BUNDLED, SPECBENCH_TO_CATEGORY, CategoryClassifier

    texts, labels = [], []
    for path in args.data:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "turns" in row:
                texts.append(row["turns"][0])
                labels.append(SPECBENCH_TO_CATEGORY.get(row["category"], row["category"]))
            else:
                texts.append(row["text"])
                labels.append(row["category"])
    print(f"training on {len(texts)} prompts in {len(set(labels))} categories ...", file=sys.stderr)
    clf = CategoryClassifier.train(texts, labels)
    out = Path(args.out) if args.out else BUNDLED
    clf.save(out)
    print(f"5-fold cross-validated accuracy: {clf.cv_accuracy:.3f}; wrote {out}")
    return 0


def cmd_bench_policy(args) -> int:
    from policy import bench

    return bench.main(args)
