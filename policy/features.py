"""What the policy knows about a request when it decides."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

# Phrases that ask the model to reuse the prompt's own text: the case where
# prompt lookup (n-gram) drafting gets its tokens accepted.
_COPY_CUES = re.compile(
    r"\b(summari[sz]e|summary|tl;?dr|rewrite|rephrase|paraphrase|translate|extract|quote|"
    r"correct|fix|edit|proofread|refactor|based on the|according to|given the following|"
    r"from the (?:text|passage|article|document)|the following)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RequestFeatures:
    category: str
    temperature: float
    top_p: float
    prompt_tokens: int
    expected_output_tokens: int
    copy_signal: float  # 0..1: how much the prompt invites copying from itself
    running: int = 0  # engine load
    waiting: int = 0
    tokens_per_step: float = 0.0
    tenant: str = ""
    requested_arm: str | None = None
    # draft name -> (rolling acceptance, samples) for this category, for the acceptance guard
    rolling_acceptance: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def load(self) -> int:
        """Requests in the engine, running or waiting: the policy's load signal."""
        return self.running + self.waiting

    def to_dict(self) -> dict:
        # shallow on purpose: dataclasses.asdict deep-copies, and this runs per request
        d = dict(self.__dict__)
        d["rolling_acceptance"] = dict(self.rolling_acceptance)
        return d

    @staticmethod
    def from_dict(d: dict) -> RequestFeatures:
        """From to_dict() output of this or an earlier version (unknown keys ignored,
        missing newer ones defaulted)."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        known["rolling_acceptance"] = {k: (float(a), float(n)) for k, (a, n) in
                                       (known.get("rolling_acceptance") or {}).items()}
        return RequestFeatures(**known)


def copy_signal(text: str) -> float:
    """0..1 from copy cues and from how much a long prompt gives to copy from."""
    # the cues sit in the instruction, at the start or the end of the prompt
    head = text if len(text) <= 700 else text[:400] + " " + text[-300:]
    cues = len(_COPY_CUES.findall(head))
    quoted = text.count('"') + text.count("\n") + text.count("“")
    size = min(len(text) / 4000, 1.0)
    return min(1.0, 0.35 * min(cues, 2) + 0.2 * size + 0.1 * min(quoted / 10, 1.0))


def build_features(text: str, *, prompt_tokens: int, temperature: float, top_p: float, max_tokens: int,
                   classifier, model, category_hint: str | None = None, expected_length_hint: int | None = None,
                   running: int = 0, waiting: int = 0, tokens_per_step: float = 0.0, tenant: str = "",
                   requested_arm: str | None = None,
                   rolling_acceptance: dict[str, tuple[float, int]] | None = None) -> RequestFeatures:
    """Everything the policy needs, from the request, its hints and the live load.
    `classifier` runs only when the request gives no category hint."""
    category = category_hint or classifier.predict(text)
    return RequestFeatures(
        category=category, temperature=temperature, top_p=top_p, prompt_tokens=prompt_tokens,
        expected_output_tokens=model.expected_output_tokens(category, max_tokens, expected_length_hint),
        copy_signal=copy_signal(text), running=running, waiting=waiting, tokens_per_step=tokens_per_step,
        tenant=tenant, requested_arm=requested_arm, rolling_acceptance=rolling_acceptance or {},
    )


_FIELDS = {f.name for f in fields(RequestFeatures)}
