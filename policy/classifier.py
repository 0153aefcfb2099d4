"""Prompt category classifier: hashed word and character n-grams into a linear model.

Stored as JSON (vectoriser settings, classes, coefficients): loading it runs no
code, unlike a pickle, so a file from anywhere can be read safely.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policy.words import tokens

# Spec-Bench's 13 labels onto the product's categories.
SPECBENCH_TO_CATEGORY = {
    "writing": "chat", "roleplay": "chat", "humanities": "chat", "stem": "qa",
    "coding": "code", "translation": "translation", "summarization": "summarization",
    "qa": "qa", "math_reasoning": "math", "math": "math", "reasoning": "math",
    "rag": "rag", "extraction": "rag",
}
CATEGORIES = ("chat", "code", "translation", "summarization", "qa", "math", "rag")
N_FEATURES = 2**16
BUNDLED = Path(__file__).resolve().parent / "data" / "category_classifier.json"


def prompt_head(text: str, limit: int = 600) -> str:
    """The start and the end of long prompts: the instruction sits at one of them,
    and featurising a 20k-character document would cost milliseconds."""
    if len(text) <= limit:
        return text
    return text[: 2 * limit // 3] + " " + text[-limit // 3:]


def hashed_features(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Feature indices and l2-normalised weights of one text: word unigrams and
    bigrams, punctuation (code and math are full of it), the first three words
    marked as such (instructions lead), and a length bucket. crc32 keeps the hash
    stable across processes, unlike Python's salted hash()."""
    toks = tokens(prompt_head(text).lower())  # UTF-8 bytes, what crc32 reads
    feats = toks + list(map(b" ".join, zip(toks, toks[1:])))
    feats += [b"^" + t for t in toks[:3]] + [b"#len%d" % min(len(text).bit_length(), 16)]
    # map() over C functions: no Python frame per feature (the decision's hot loop)
    idx = np.fromiter(map(zlib.crc32, feats), dtype=np.int64, count=len(feats)) % N_FEATURES
    idx.sort()  # np.unique by hand, in few array calls: its wrapper (and np.diff's, np.append's) cost more
    edge = np.empty(len(idx) + 1, dtype=bool)  # where a run of equal indices starts, and the end
    edge[0] = edge[-1] = True
    np.not_equal(idx[1:], idx[:-1], out=edge[1:-1])
    b = edge.nonzero()[0]
    w = (b[1:] - b[:-1]).astype(np.float64)  # occurrences of each feature
    return idx[b[:-1]], w * (1.0 / math.sqrt(w @ w))


def featurize(texts: list[str]):
    from scipy.sparse import csr_matrix

    rows, cols, vals = [], [], []
    for i, t in enumerate(texts):
        idx, w = hashed_features(t)
        rows.append(np.full(len(idx), i))
        cols.append(idx)
        vals.append(w)
    return csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(len(texts), N_FEATURES))


@dataclass
class CategoryClassifier:
    classes: list[str]
    coef: np.ndarray  # [C, N_FEATURES]
    intercept: np.ndarray  # [C]
    cv_accuracy: float | None = None

    def __post_init__(self):
        self._by_feature = np.ascontiguousarray(self.coef.T)  # [N_FEATURES, C]: a gather reads whole rows

    def scores(self, text: str) -> np.ndarray:
        idx, w = hashed_features(text)
        return w @ self._by_feature[idx] + self.intercept  # [C]

    def predict_proba(self, text: str) -> dict[str, float]:
        s = self.scores(text)
        e = np.exp(s - s.max())
        return dict(zip(self.classes, (e / e.sum()).tolist()))

    def predict(self, text: str) -> str:
        return self.classes[int(np.argmax(self.scores(text)))]

    # training and storage
    @classmethod
    def train(cls, texts: list[str], labels: list[str], folds: int = 5, seed: int = 0) -> CategoryClassifier:
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import StratifiedKFold, cross_val_score

        x = featurize(texts)
        y = np.array(labels)
        # balanced: chat, code and math have 5-15 examples each in the dev split
        model = LogisticRegression(C=10.0, max_iter=2000, class_weight="balanced")
        smallest = min(np.unique(y, return_counts=True)[1])
        cv = None
        if folds > 1 and smallest >= 2:
            skf = StratifiedKFold(n_splits=min(folds, smallest), shuffle=True, random_state=seed)
            cv = float(cross_val_score(model, x, y, cv=skf).mean())
        model.fit(x, y)
        coef, intercept = model.coef_, model.intercept_
        if len(model.classes_) == 2:  # sklearn stores one row for binary problems
            coef = np.vstack([-coef[0], coef[0]])
            intercept = np.array([-intercept[0], intercept[0]])
        return cls(list(model.classes_), coef, intercept, cv)

    def save(self, path: Path) -> None:
        rows, cols = np.nonzero(self.coef)
        path.write_text(json.dumps({
            "format": "specgate.category_classifier.v2", "n_features": N_FEATURES,
            "classes": self.classes, "intercept": self.intercept.tolist(), "cv_accuracy": self.cv_accuracy,
            "coef_sparse": [rows.tolist(), cols.tolist(), np.round(self.coef[rows, cols], 6).tolist()],
        }))

    @classmethod
    def load(cls, path: Path = BUNDLED) -> CategoryClassifier:
        d = json.loads(Path(path).read_text())
        if d.get("format") != "specgate.category_classifier.v2" or d.get("n_features") != N_FEATURES:
            raise ValueError(f"{path}: not a specgate category classifier (v2, {N_FEATURES} features)")
        coef = np.zeros((len(d["classes"]), N_FEATURES))
        r, c, v = d["coef_sparse"]
        coef[np.array(r, dtype=int), np.array(c, dtype=int)] = v
        return cls(d["classes"], coef, np.array(d["intercept"]), d.get("cv_accuracy"))


def specbench_training_set(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The first turn of every Spec-Bench row, labelled with the product category
    (later turns refer back to it and say little on their own)."""
    return [r["turns"][0] for r in rows], [SPECBENCH_TO_CATEGORY[r["category"]] for r in rows]
