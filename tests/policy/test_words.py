"""The features' word splits give the regexes' tokens, in UTF-8, on any text."""

import random
import re

from policy.words import UTF8, outside_ascii, tokens, words

WORD = re.compile(r"\w+")
TOKEN = re.compile(r"\w+|[^\w\s]")
# ASCII (controls, the spaces bytes.split() does not cut at, punctuation), letters and digits outside it
# (accented, Greek with its final sigma, Arabic-Indic digits, fractions, combining marks, CJK, Hangul),
# marks and spaces outside it, an astral letter and emoji, and lone surrogates
ALPHABET = ([chr(c) for c in range(128)]
            + list("éüßçΣσςİıµ£€“”‘’—–…\u00a0\u2003\u2028\u3000\u0085\u0307\u0301中文字日本語한국어١٢٣²½ⅷ")
            + ["\U0001D400", "\U0001F600", "\ud800", "\udfff"])


def utf8(found: list[str]) -> list[bytes]:
    return [t.encode("utf-8", UTF8) for t in found]


def test_words_and_tokens_are_the_regexes_on_random_texts():
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.5:
            text = text.lower()
        assert words(text) == utf8(WORD.findall(text)), repr(text)
        assert tokens(text) == utf8(TOKEN.findall(text)), repr(text)


def test_marks_stand_alone_and_letters_outside_ascii_join_their_words():
    text = "naïve café—“quoted”\u00a0x_1;y\x1cz 中文 ½"
    assert tokens(text) == utf8(["naïve", "café", "—", "“", "quoted", "”", "x_1", ";", "y", "z", "中文", "½"])
    assert words(text) == utf8(["naïve", "café", "quoted", "x_1", "y", "z", "中文", "½"])


def test_the_characters_outside_ascii_come_in_order():
    assert outside_ascii("a“b”ç\ud800".encode("utf-8", UTF8)) == "“”ç\ud800"
    assert outside_ascii(b"plain") == ""
