import json

import pytest

from policy.classifier import (
    BUNDLED,
    CATEGORIES,
    SPECBENCH_TO_CATEGORY,
    CategoryClassifier,
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
