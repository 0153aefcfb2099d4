import pytest

from policy.features import RequestFeatures
from policy.rules import RulesError, load_rules, parse_rules
from tests.conftest import REPO


@pytest.mark.parametrize("text,expected", [
    ("rules: []", "missing 'default'"),
    ("- just\n- a list", "expected a mapping"),
    ("default: {}\nrules: [{name: a, when: {}, then: {}}", "not valid YAML"),
    ("default: {}\nrules:\n  - name: a\n    then: {force: plain}\n    colour: red",
     "rule #1 'a': field colour: unknown key"),
    ("default: {}\nrules:\n  - name: hot\n    when: {temprature: {gt: 1}}\n    then: {force: plain}",
     "rule #1 'hot': field when.temprature: unknown key"),
    ("default: {}\nrules:\n  - name: c\n    when: {category: [poetry]}\n    then: {}", "unknown categories ['poetry']"),
    ("default: {}\nrules:\n  - name: r\n    when: {load: {}}\n    then: {}",
     "field when.load: Value error, give at least one"),
    ("default: {}\nrules:\n  - name: r\n    when: {load: {gt: 5, lt: 2}}\n    then: {}", "empty range"),
    ("default: {}\nrules:\n  - name: f\n    then: {force: 'ngram:x'}", "field then.force"),
    ("default: {}\nrules:\n  - name: f\n    then: {force: plain, explore: 0.1}", "force cannot be combined"),
    ("default: {}\nrules:\n  - name: g\n    then: {gamma: {min: 5, max: 2}}",
     "field then.gamma: Value error, min (5) must be <= max (2)"),
    ("default: {}\nrules:\n  - name: e\n    then: {explore: 1.5}", "field then.explore"),
    ("default: {}\nrules:\n  - name: g\n    then: {guard: {min_acceptance: 2}}", "field then.guard.min_acceptance"),
    ("default: {}\nrules:\n  - {name: a, then: {}}\n  - {name: a, then: {}}", "rule names must be unique: ['a']"),
    ("default: {}\nrules:\n  - {then: {}}", "rule #1: field name: Field required"),
    ("default: {}\nrules:\n  - name: t\n    then: {}\n    when: {temperature: {gt: hot}}", "field when.temperature.gt"),
    ("default: {colour: red}", "field default.colour: unknown key"),
    ("version: 2\ndefault: {}", "field version"),
])
def test_bad_rules_give_precise_errors(text, expected):
    with pytest.raises(RulesError) as e:
        parse_rules(text, "ops.yaml")
    assert str(e.value).startswith("ops.yaml: ")
    assert expected in str(e.value)


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(RulesError, match="missing.yaml: cannot read"):
        load_rules(tmp_path / "missing.yaml")


def test_first_match_wins_and_explains_the_skipped_rules():
    rules = parse_rules("""
rules:
  - {name: hot, when: {temperature: {gt: 1}}, then: {force: plain}}
  - {name: code, when: {category: [code]}, then: {drafts: [ngram]}}
  - {name: any-code-again, when: {category: [code]}, then: {force: plain}}
default: {}
""")
    f = RequestFeatures("code", 0.2, 1, 10, 100, 0.1)
    rule, then, skipped = rules.match(f)
    assert rule.name == "code" and then.drafts == ["ngram"]
    assert skipped == ["hot: temperature 0.2 is not > 1"]
    rule, then, _ = rules.match(RequestFeatures("chat", 0.2, 1, 10, 100, 0.1))
    assert rule is None and then == rules.default


def test_the_decision_path_picks_the_rule_the_explanation_names():
    rules = parse_rules("""
rules:
  - {name: busy, when: {load: {gte: 8}, prompt_length: {lt: 500}}, then: {force: plain}}
  - {name: tenant-a, when: {tenant: [a], top_p: {lte: 0.9}}, then: {drafts: [ngram]}}
  - {name: long, when: {expected_length: {gt: 200}}, then: {gamma: {min: 2, max: 4}}}
default: {}
""")
    cases = [RequestFeatures(cat, t, top_p, plen, out, 0.1, running=run, tenant=ten)
             for cat in ("chat", "code") for t in (0.0, 1.0) for top_p in (0.8, 1.0) for plen in (10, 900)
             for out in (50, 300) for run in (0, 9) for ten in ("a", "b")]
    names = set()
    for f in cases:
        rule, then, _ = rules.match(f)
        assert rules.first(f) == (rule, then)
        names.add(rule.name if rule else None)
    assert names == {"busy", "tenant-a", "long", None}  # every branch taken


def test_shipped_default_rules_are_valid():
    rules = load_rules(REPO / "policy" / "default_rules.yaml")
    assert rules.rules and rules.digest


def test_a_running_gateway_reloads_valid_rules_and_keeps_the_old_on_an_invalid_file(tmp_path):
    import time

    from gateway.policy_state import PolicyState

    path = tmp_path / "rules.yaml"
    path.write_text("default: {explore: 0.0}\n")
    state = PolicyState(load_rules(path), rules_path=str(path))
    state.watch_rules(0.05)
    try:
        first = state.rules.digest
        path.write_text("rules:\n  - {name: all-plain, then: {force: plain}}\ndefault: {}\n")
        deadline = time.monotonic() + 5
        while state.rules.digest == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [r.name for r in state.rules.rules] == ["all-plain"]
        good = state.rules.digest
        path.write_text("rules:\n  - {name: broken, then: {forse: plain}}\ndefault: {}\n")
        time.sleep(0.5)
        assert state.rules.digest == good  # refused; the previous rules stay live
        assert state.reload_rules() is False
    finally:
        state.close()
