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

from policy.words import UTF8, outside_ascii
from policy.words import words as split_words

# Phrases that ask the model to reuse the prompt's own text: the case where
# prompt lookup (n-gram) drafting gets its tokens accepted.
_CUES = (r"summari[sz]e", "summary", r"tl;?dr", "rewrite", "rephrase", "paraphrase", "translate", "extract",
         "quote", "correct", "fix", "edit", "proofread", "refactor", "based on the", "according to",
         "given the following", r"from the (?:text|passage|article|document)", "the following")
# the lookahead on the cues' first letters lets most word starts fail at once (2x faster)
_COPY_CUES = re.compile(rf"\b(?=[{''.join(sorted({c[0] for c in _CUES}))}])({'|'.join(_CUES)})\b", re.IGNORECASE)
# The code signal's markers, the matches of `[{};]|==|=>|->|```|\bdef |\bclass |\breturn\b|\bimport
# |\bfunction\b|\bprint\(`: no marker's characters can start or end another's (nor change
# where a word starts), so each kind is counted apart: the single characters and the
# arrows by str.count, a run of "=" by a pattern that starts with its literal (searched,
# not tried at every position), the keywords by find with their word boundaries checked.
# A regex scan of the whole alternation took ~25 us on a 1,000-character sample.
_EQUALS = re.compile(r"==|=>")
_KEYWORDS = ("def ", "class ", "import ", "print(")  # a word starts there
_WHOLE_WORDS = ("return", "function")  # and ends there too
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
    words = split_words(s.lower())  # UTF-8 bytes: trigrams compare alike
    if len(words) >= 6:
        grams = list(zip(words, words[1:], words[2:]))
        repetition = 1.0 - len(set(grams)) / len(grams)
    else:
        repetition = 0.0
    code = min(1.0, code_markers(s) / max(len(s) / 40, 1.0))
    non_ascii = 0.0
    if not s.isascii():  # most prompts stop at this one C-level scan
        b = s.encode("utf-8", UTF8)
        ascii_letters = len(b) - len(b.translate(None, _ASCII_LETTERS))
        # isalpha per character only where it is needed: outside ASCII, usually a few characters
        other_letters = sum(map(str.isalpha, outside_ascii(b)))
        letters = ascii_letters + other_letters
        non_ascii = other_letters / letters if letters else 0.0
    return round(repetition, 4), round(code, 4), round(non_ascii, 4)


def code_markers(s: str) -> int:
    """How many of the code signal's markers `s` holds (see _EQUALS)."""
    n = s.count("{") + s.count("}") + s.count(";") + s.count("->") + s.count("```") + len(_EQUALS.findall(s))
    for word in _KEYWORDS + _WHOLE_WORDS:
        whole = word in _WHOLE_WORDS
        i = s.find(word)
        while i >= 0:
            end = i + len(word)
            if (i == 0 or not _is_word(s[i - 1])) and not (whole and end < len(s) and _is_word(s[end])):
                n += 1
            i = s.find(word, end)
    return n


def _is_word(c: str) -> bool:
    """What the regexes' \\w matches (a Unicode letter or digit, or _)."""
    return c.isalnum() or c == "_"


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
