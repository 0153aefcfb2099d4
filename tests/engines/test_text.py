from engines.text import IncrementalText
from tests.helpers import WORDS, tiny_tokenizer


def ids(text):
    return [WORDS.index(w) for w in text.split()]


def test_deltas_concatenate_to_the_full_text():
    t = IncrementalText(tiny_tokenizer())
    pieces = [t.push(ids("hello world")), t.push(ids("the cat")), t.finish()]
    assert "".join(pieces) == "hello world the cat" == t.text
    assert not t.stopped


def test_stop_string_truncates_and_is_never_streamed():
    t = IncrementalText(tiny_tokenizer(), stop=("cat sat",))
    streamed = t.push(ids("hello the"))
    streamed += t.push(ids("cat"))  # could be the start of the stop string: held back
    assert "cat" not in streamed
    streamed += t.push(ids("sat world"))
    streamed += t.finish()
    assert t.stopped
    assert streamed == t.text == "hello the "


def test_earliest_of_several_stop_strings_wins():
    t = IncrementalText(tiny_tokenizer(), stop=("world", "hello"))
    t.push(ids("the hello cat world"))
    assert t.stopped and t.text == "the "
