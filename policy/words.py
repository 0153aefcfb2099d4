"""The features' word splits, as UTF-8 bytes.

The same tokens as the regexes `\\w+` (words) and `\\w+|[^\\w\\s]` (words and
marks: every other character that is not a space, alone) find in a str, with
Python's Unicode classes (a word character is alphanumeric or `_`, a space is
what `str.isspace` says), each encoded as UTF-8. Found by C-level bytes
operations instead of a regex scan: the non-ASCII characters a text holds (a
few distinct ones, even in a long prompt) are classed one by one and replaced
where they separate tokens, then one `translate` classes every ASCII byte and
`split` cuts. A decision's tail is its longest prompts, where the regex scans
were ~40 ns a character on an AMD EPYC; these take about a third of that.

Lone surrogates (the gateway refuses them; a caller of the library may not) are
encoded as they stand ("surrogatepass"): they are marks to both regexes, and here too.
"""

from __future__ import annotations

UTF8 = "surrogatepass"  # lone surrogates encode; everything else is plain UTF-8
_ASCII = bytes(range(128))
_WORD_ASCII = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_SPACE_ASCII = frozenset(c for c in range(128) if chr(c).isspace())  # \x1c-\x1f too, which bytes.split() keeps
# words: every ASCII byte that is not a word character becomes a space (bytes >= 0x80 stay)
_WORDS = bytes(c if c in _WORD_ASCII or c >= 128 else 32 for c in range(256))
# words and marks: every ASCII space becomes b" ", so that split() cuts where the regex does
_SPACES = bytes(32 if c in _SPACE_ASCII else c for c in range(256))
# deleted to find the ASCII marks a text holds: words, spaces and every non-ASCII byte
_NOT_MARKS = bytes(c for c in range(256) if c in _WORD_ASCII or c in _SPACE_ASCII or c >= 128)


def outside_ascii(b: bytes) -> str:
    """The non-ASCII characters of UTF-8 `b`, in order (deleting its ASCII bytes leaves
    whole multi-byte sequences)."""
    return b.translate(None, _ASCII).decode("utf-8", UTF8)


def words(text: str) -> list[bytes]:
    """`re.findall(r"\\w+", text)`, each token in UTF-8."""
    b = text.encode("utf-8", UTF8)
    if not text.isascii():
        for c in set(outside_ascii(b)):
            if not c.isalnum():  # a space or a mark: it separates words
                b = b.replace(c.encode("utf-8", UTF8), b" ")
    return b.translate(_WORDS).split()


def tokens(text: str) -> list[bytes]:
    """`re.findall(r"\\w+|[^\\w\\s]", text)`, each token in UTF-8."""
    b = text.encode("utf-8", UTF8)
    if not text.isascii():
        for c in set(outside_ascii(b)):
            if c.isspace():
                b = b.replace(c.encode("utf-8", UTF8), b" ")
            elif not c.isalnum():
                e = c.encode("utf-8", UTF8)
                b = b.replace(e, b" " + e + b" ")
    b = b.translate(_SPACES)
    for m in set(b.translate(None, _NOT_MARKS)):  # the ASCII marks present, each a token of its own
        m = bytes((m,))
        b = b.replace(m, b" " + m + b" ")
    return b.split()
