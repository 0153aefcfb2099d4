"""Train the prompt category classifier from labelled JSONL (Spec-Bench rows with
`category` and `turns`, or `{category, text}` rows) and report its 5-fold
cross-validated accuracy. Spec-Bench labels are mapped onto the product's
categories."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_arguments(p) -> None:
    ps = p.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    t = ps.add_parser("train-classifier", help="retrain the category classifier and report its accuracy")
    t.add_argument("--data", nargs="+", required=True, help="JSONL files (Spec-Bench rows or {category, text} rows)")
    t.add_argument("--out", help="where to write the classifier JSON (default: the bundled one)")


def main(args) -> int:
    from policy.classifier import BUNDLED, SPECBENCH_TO_CATEGORY, CategoryClassifier

    texts, labels = [], []
    for path in args.data:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "turns" in row:
                    texts.append(row["turns"][0])
                    labels.append(SPECBENCH_TO_CATEGORY.get(row["category"], row["category"]))
                else:
                    texts.append(row["text"])
                    labels.append(row["category"])
            except (ValueError, KeyError, TypeError, IndexError) as e:
                print(f"error: {path}:{n}: {e}", file=sys.stderr)
                return 2
    print(f"training on {len(texts)} prompts in {len(set(labels))} categories ...", file=sys.stderr)
    clf = CategoryClassifier.train(texts, labels)
    out = Path(args.out) if args.out else BUNDLED
    clf.save(out)
    print(f"5-fold cross-validated accuracy: {clf.cv_accuracy:.3f}; wrote {out}")
    return 0
