import json
import re
import zlib
from collections import Counter

import numpy as np
import pytest

from policy.classifier import (
    BUNDLED,
    CATEGORIES,
    N_FEATURES,
    SPECBENCH_TO_CATEGORY,
    CategoryClassifier,
    hashed_features,
    specbench_training_set,
)


def test_every_specbench_label_maps_to_a_product_category():
    assert set(SPECBENCH_TO_CATEGORY.values()) <= set(CATEGORIES)


def test_bundled_classifier_loads_and_classifies_obvious_prompts():
    clf = CategoryClassifier.load(BUNDLED)
    assert set(clf.classes) == set(CATEGORIES)
    assert clf.cv_accuracy is not None and clf.cv_accuracy >= 0.8
    assert clf.predict("Translate German to English: Der Hund schläft im Garten.") == "translation"
    assert clf.predict("Summarize: The company reported record profits on Tuesday, ...") == "summarization"
    p = clf.predict_proba("What is 12 * 7 + 3?")
    assert abs(sum(p.values()) - 1) < 1e-9


def test_retraining_from_labelled_data_generalises(specbench_rows, tmp_path):
    # hold out every third row: trained on the rest, it must still label most correctly
    texts, labels = specbench_training_set(specbench_rows)
    train = [(t, lab) for i, (t, lab) in enumerate(zip(texts, labels)) if i % 3]
    test = [(t, lab) for i, (t, lab) in enumerate(zip(texts, labels)) if not i % 3]
    clf = CategoryClassifier.train([t for t, _ in train], [lab for _, lab in train], folds=0)
    acc = sum(clf.predict(t) == lab for t, lab in test) / len(test)
    assert acc >= 0.8
    path = tmp_path / "clf.json"
    clf.save(path)
    again = CategoryClassifier.load(path)
    assert [again.predict(t) for t, _ in test[:20]] == [clf.predict(t) for t, _ in test[:20]]


def test_a_file_of_another_kind_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "pickle-please"}))
    with pytest.raises(ValueError, match="not a specgate category classifier"):
        CategoryClassifier.load(path)


def test_hashed_features_count_each_feature_once_and_are_l2_normalised():
    """hashed_features against a plain count of the same features (crc32 of word
    unigrams, bigrams, the first three words marked, a length bucket): sorted
    distinct indices, weights their counts over the counts' l2 norm (a repeated
    word counts twice)."""
    for text in ("Fix this code: x = x + 1; x = x + 1;", "the the the cat", "a", "Résumé, s'il vous plaît!"):
        toks = re.findall(r"\w+|[^\w\s]", text.lower())
        feats = toks + [" ".join(p) for p in zip(toks, toks[1:])] + ["^" + t for t in toks[:3]]
        feats.append(f"#len{min(len(text).bit_length(), 16)}")
        counts = Counter(zlib.crc32(f.encode()) % N_FEATURES for f in feats)
        want_idx = np.array(sorted(counts))
        want_w = np.array([counts[i] for i in want_idx], dtype=float)
        idx, w = hashed_features(text)
        assert idx.tolist() == want_idx.tolist()
        np.testing.assert_allclose(w, want_w / np.sqrt((want_w ** 2).sum()))
