"""Operator rules: `check FILE` validates (errors name the file, the rule and the
field); `explain FILE --request JSON` shows which rule a request matches, why
the earlier ones did not, and the decision the prior would make."""

from __future__ import annotations

import json
import random
import sys


def add_arguments(r) -> None:
    rs = r.add_subparsers(dest="rules_command", required=True, metavar="ACTION")
    c = rs.add_parser("check", help="validate a rules file; exit 1 with precise errors when invalid")
    c.add_argument("file")
    c.set_defaults(action=check)
    e = rs.add_parser("explain", help="show the rule a request matches, why, and the decision")
    e.add_argument("file")
    e.add_argument("--request", required=True,
                   help='JSON: {"prompt": "...", "temperature": 0, "top_p": 1, "max_tokens": 128, '
                        '"category": null, "expected_length": null, "tenant": "", "running": 0, "waiting": 0, '
                        '"arm": null}')
    e.add_argument("--arms", default="ngram,selfspec:1-8",
                   help="drafts and γ range the engines serve, or an explicit list like plain,ngram:4 "
                        "(default: %(default)s)")
    e.set_defaults(action=explain)


def main(args) -> int:
    return args.action(args)


def check(args) -> int:
    from policy.rules import RulesError, load_rules

    try:
        rules = load_rules(args.file)
    except RulesError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.file}: OK, {len(rules.rules)} rules, version {rules.digest}")
    return 0


def explain(args) -> int:
    from engines.arms import ArmMenu
    from policy.classifier import CategoryClassifier
    from policy.decide import decide
    from policy.features import build_features, estimate_prompt_tokens
    from policy.model import prior_model
    from policy.rules import RulesError, load_rules

    try:
        rules = load_rules(args.file)
        menu = ArmMenu.parse(args.arms)
        req = json.loads(args.request)
        if not isinstance(req, dict):
            raise ValueError("--request must be a JSON object")
        text = str(req.get("prompt", ""))
        model = prior_model()
        f = build_features(
            text, prompt_tokens=estimate_prompt_tokens(text), temperature=float(req.get("temperature", 0)),
            top_p=float(req.get("top_p", 1)), max_tokens=int(req.get("max_tokens", 128)),
            classifier=CategoryClassifier.load(), model=model, category_hint=req.get("category"),
            expected_length_hint=req.get("expected_length"), running=int(req.get("running", 0)),
            waiting=int(req.get("waiting", 0)), tenant=str(req.get("tenant", "")), requested_arm=req.get("arm"),
        )
    except (RulesError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rule, _, skipped = rules.match(f)
    print(f"features: category={f.category} temperature={f.temperature:g} top_p={f.top_p:g} "
          f"prompt≈{f.prompt_tokens} tokens expected_length={f.expected_output_tokens} load={f.load} "
          f"tenant={f.tenant!r} copy_signal={f.copy_signal:.2f}")
    for s in skipped:
        print(f"  skipped {s}")
    print(f"matched: {rule.name if rule else 'default'}")
    d = decide(f, rules, model, random.Random(0), menu)
    print(f"decision: {d.arm.name} ({d.source}) — {d.reason}")
    return 0
