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


def stream(tokenizer, ids, cuts, stop=()):
    """Deltas of `ids` pushed in the pieces `cuts` makes, then finish; and the object."""
    t, pieces, start = IncrementalText(tokenizer, stop), [], 0
    for end in sorted(cuts) + [len(ids)]:
        pieces.append(t.push(ids[start:end]))
        start = end
    pieces.append(t.finish())
    return pieces, t


def test_streamed_text_is_the_whole_decode_however_the_tokens_arrive():
    import random

    tok, rng = tiny_tokenizer(), random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        cuts = rng.sample(range(1, len(ids) + 1), rng.randrange(len(ids) + 1))
        pieces, t = stream(tok, ids, cuts)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == t.text == whole
        pieces, t = stream(tok, ids, cuts, stop=("w1",))
        assert "".join(pieces) == t.text == (whole[:whole.find("w1")] if "w1" in whole else whole)
