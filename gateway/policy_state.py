"""The live policy of a gateway: model, rules and classifier, and the watcher
that reloads the rules file when it changes."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from policy.classifier import CategoryClassifier
from policy.model import PolicyModel, prior_model
from policy.rules import RulesError, RuleSet, load_rules

log = logging.getLogger(__name__)


class PolicyState:
    """Swapped atomically (one attribute assignment each), so a decision sees one
    consistent model and one consistent rule set."""

    def __init__(self, rules: RuleSet, model: PolicyModel | None = None,
                 classifier: CategoryClassifier | None = None, rules_path: str | None = None):
        self.rules = rules
        self.model = model or prior_model()
        self.classifier = classifier or CategoryClassifier.load()
        self.rules_path = rules_path
        self._rules_mtime = Path(rules_path).stat().st_mtime_ns if rules_path else None
        self._stop = threading.Event()

    def set_model(self, model: PolicyModel) -> None:
        self.model = model
        log.info("policy model now %s", model.version)

    def reload_rules(self) -> bool:
        """Re-read the rules file; an invalid file is refused and the old rules stay."""
        if not self.rules_path:
            return False
        try:
            rules = load_rules(self.rules_path)
        except RulesError as e:
            log.error("rules reload refused, keeping version %s: %s", self.rules.digest, e)
            return False
        if rules.digest != self.rules.digest:
            log.info("rules reloaded from %s: version %s -> %s", self.rules_path, self.rules.digest, rules.digest)
        self.rules = rules
        return True

    def watch_rules(self, interval: float) -> None:
        """Poll the file's mtime on a thread of its own until close()."""
        if not self.rules_path:
            return

        def loop():
            while not self._stop.wait(interval):
                try:
                    mtime = Path(self.rules_path).stat().st_mtime_ns
                except OSError:
                    continue
                if mtime != self._rules_mtime:
                    self._rules_mtime = mtime
                    self.reload_rules()

        threading.Thread(target=loop, name="specgate-rules", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
