"""The per-request text signals: what they measure, on texts where the answer is known."""

import random
import re

from policy.features import SAMPLE_CHARS, code_markers, copy_signal, text_signals


def test_the_share_of_letters_outside_ascii_counts_letters_only():
    for text in ("Привет, мир! hello 123 ¿qué?", "£1.2 million — “quoted” ½ ✓ naïve", "日本語 and English"):
        letters = [c for c in text if c.isalpha()]
        assert text_signals(text)[2] == round(sum(not c.isascii() for c in letters) / len(letters), 4)
    assert text_signals("plain ascii, 42 digits; no letters beyond")[2] == 0.0
    assert text_signals("— ½ ✓ 123")[2] == 0.0  # symbols outside ASCII, no letters at all


def test_the_code_signal_counts_exactly_the_documented_markers():
    # the plain alternation the counts must agree with
    reference = re.compile(r"[{};]|==|=>|->|```|\bdef |\bclass |\breturn\b|\bimport |\bfunction\b|\bprint\(")
    for text in ("a==>b === -> ```x`` def f(): return 1; import os; function(){print(x)} classy class returned",
                 "redefine the returnee's print-out; undef x", "if (a => b) { c -> d; }" * 3):
        assert code_markers(text) == len(reference.findall(text))
    # random texts of markers, their pieces and the characters around them
    pieces = ["{", "}", ";", "=", "==", ">", "-", "`", "``", "def ", "class ", "return", "function", "import ",
              "print(", "print", "de", "f ", "re", "x", "_", "é", "ß", "٣", " ", "\n", "(", "—", "”", "r", "n"]
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert code_markers(text) == len(reference.findall(text)), text


def test_code_and_repetition_are_seen_where_they_are():
    code = "```python\ndef f(x):\n    return {x: 1}\n```"
    prose = "Tell me about the history of Rome in a few words."
    assert text_signals(code)[1] > 0.5 and text_signals(prose)[1] == 0.0
    assert text_signals("a b c " * 4)[0] == 0.7 and text_signals(prose)[0] == 0.0  # 3 of 10 trigrams distinct


def test_long_prompts_are_read_from_a_bounded_sample():
    filler = "lorem ipsum dolor sit amet " * 2000  # repetitive, far longer than the sample
    assert len(filler) > 10 * SAMPLE_CHARS
    assert text_signals(filler + "def f(): return 1")[1] > 0  # the tail is in the sample
    assert copy_signal("Summarize the following article.") > copy_signal("Tell me a joke.")
