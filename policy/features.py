"""What the policy knows about a request when it decides.

Per request, not only per category, and cheap (a bounded sample of the prompt,
no tokenizer): the category (hint, else the classifier), sampling shape,
lengths, the live load, and signals of how the answer will relate to the
prompt:

    copy_signal    instructions that ask to reuse the prompt's text (summarise,
                   extract, rewrite, fix this code ...) and how much there is to copy
    repetition     how much the prompt repeats itself (its word trigrams seen twice)
    code           how much it looks like code (fences, symbols, keywords)
    non_ascii      the share of letters outside ASCII (script, language)
    turns          chat messages in the request
    length_ratio   max_tokens over what answers in this category usually take
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field, fields

# Phrases that ask the model to reuse the prompt's own text: the case where
# prompt lookup (n-gram) drafting gets its tokens accepted.
_CUES = (r"summari[sz]e", "summary", r"tl;?dr", "rewrite", "rephrase", "paraphrase", "translate", "extract",
         "quote", "correct", "fix", "edit", "proofread", "refactor", "based on the", "according to",
         "given the following", r"from the (?:text|passage|article|document)", "the following")
# the lookahead on the cues' first letters lets most word starts fail at once (2x faster)
_COPY_CUES = re.compile(rf"\b(?=[{''.join(sorted({c[0] for c in _CUES}))}])({'|'.join(_CUES)})\b", re.IGNORECASE)
# single characters first, then one \b before the keywords: the same matches, 3-4x
# faster than an alternation that tries every \b branch at every position; the
# lookahead on every alternative's first character halves it again
_CODE = re.compile(r"(?=[-{};=`cdfipr])(?:[{};]|==|=>|->|```|\b(?:def |class |return\b|import |function\b|print\())")
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_WORD = re.compile(r"\w+")
_ASCII_LETTERS = string.ascii_letters.encode()
SAMPLE_CHARS = 1000  # what the features look at: the head and the tail of long prompts


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
    # draft name -> (rolling acceptance, rounds of evidence) for this tenant and category, for the guard
    rolling_acceptance: dict[str, tuple[float, float]] = field(default_factory=dict)
    repetition: float = 0.0  # 0..1
    code: float = 0.0  # 0..1
    non_ascii: float = 0.0  # 0..1
    turns: int = 1
    length_ratio: float = 1.0  # max_tokens / the category's typical output length

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


def sample(text: str) -> str:
    """The head and the tail of long prompts (instructions sit at one of them)."""
    if len(text) <= SAMPLE_CHARS:
        return text
    return text[: 2 * SAMPLE_CHARS // 3] + "\n" + text[-SAMPLE_CHARS // 3:]


def copy_signal(text: str) -> float:
    """0..1 from copy cues and from how much a long prompt gives to copy from."""
    head = text if len(text) <= 700 else text[:400] + " " + text[-300:]
    cues = len(_COPY_CUES.findall(head))
    quoted = text.count('"') + text.count("\n") + text.count("“")
    size = min(len(text) / 4000, 1.0)
    return min(1.0, 0.35 * min(cues, 2) + 0.2 * size + 0.1 * min(quoted / 10, 1.0))


def text_signals(text: str) -> tuple[float, float, float]:
    """(repetition, code, non_ascii) of a prompt, from a bounded sample of it."""
    s = sample(text)
    words = _WORD.findall(s.lower())
    if len(words) >= 6:
        grams = list(zip(words, words[1:], words[2:]))
        repetition = 1.0 - len(set(grams)) / len(grams)
    else:
        repetition = 0.0
    code = min(1.0, len(_CODE.findall(s)) / max(len(s) / 40, 1.0))
    non_ascii = 0.0
    if not s.isascii():  # most prompts stop at this one C-level scan
        ascii_part = s.encode("ascii", "ignore")
        ascii_letters = len(ascii_part) - len(ascii_part.translate(None, _ASCII_LETTERS))
        # isalpha per character only where it is needed: outside ASCII, usually a few characters
        other_letters = sum(map(str.isalpha, "".join(_NON_ASCII.findall(s))))
        letters = ascii_letters + other_letters
        non_ascii = other_letters / letters if letters else 0.0
    return round(repetition, 4), round(code, 4), round(non_ascii, 4)


def estimate_prompt_tokens(text: str) -> int:
    """The prompt's length in tokens as the policy sees it: ~4 characters a token (the
    decision runs before, and without, the engine's tokenizer)."""
    return max(1, len(text) // 4)


def build_features(text: str, *, prompt_tokens: int, temperature: float, top_p: float, max_tokens: int,
                   classifier, model, category_hint: str | None = None, expected_length_hint: int | None = None,
                   running: int = 0, waiting: int = 0, tokens_per_step: float = 0.0, tenant: str = "",
                   requested_arm: str | None = None, turns: int = 1,
                   rolling_acceptance: dict[str, tuple[float, float]] | None = None) -> RequestFeatures:
    """Everything the policy needs, from the request, its hints and the live load.
    `classifier` runs only when the request gives no category hint."""
    category = category_hint or classifier.predict(text)
    repetition, code, non_ascii = text_signals(text)
    typical = model.output_tokens.get(category) or 0
    return RequestFeatures(
        category=category, temperature=temperature, top_p=top_p, prompt_tokens=prompt_tokens,
        expected_output_tokens=model.expected_output_tokens(category, max_tokens, expected_length_hint),
        copy_signal=copy_signal(text), running=running, waiting=waiting, tokens_per_step=tokens_per_step,
        tenant=tenant, requested_arm=requested_arm, rolling_acceptance=rolling_acceptance or {},
        repetition=repetition, code=code, non_ascii=non_ascii, turns=turns,
        length_ratio=round(max_tokens / typical, 3) if typical else 1.0,
    )


_FIELDS = {f.name for f in fields(RequestFeatures)}
