"""StopMatcher: streaming stop-sequence matching over text deltas."""

import random

import pytest

from exo.engine.stop_sequences import StopMatcher


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool, str]:
    """Feed deltas until a stop hits; returns (per-feed outputs, hit, flushed tail)."""
    matcher = StopMatcher(stops)
    outputs: list[str] = []
    for delta in deltas:
        text, hit = matcher.feed(delta)
        outputs.append(text)
        if hit:
            return outputs, True, matcher.flush()
    return outputs, False, matcher.flush()


def expected_output(stops: tuple[str, ...], text: str) -> tuple[str, bool]:
    """What a client must see in total: the text up to the earliest stop occurrence."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize(
    ("stops", "deltas", "outputs", "hit", "flushed"),
    [
        # No stops: everything passes straight through, nothing held.
        ((), ["Hello", " world"], ["Hello", " world"], False, ""),
        ((), ["", "a", ""], ["", "a", ""], False, ""),
        # Stop entirely inside one delta: the text before it is emitted.
        (("STOP",), ["abcSTOPdef"], ["abc"], True, ""),
        (("STOP",), ["STOP"], [""], True, ""),
        (("STOP",), ["x", "STOPy", "never fed"], ["x", ""], True, ""),
        # Stop split across deltas: the partial prefix is held back, never sent.
        (("STOP",), ["abcST", "OPdef"], ["abc", ""], True, ""),
        (("STOP",), ["abcS", "T", "O", "P"], ["abc", "", "", ""], True, ""),
        (("</s>",), ["hi<", "/", "s>", "more"], ["hi", "", ""], True, ""),
        # A held-back prefix that turns out not to be a stop is released.
        (("STOP",), ["abcST", "ART"], ["abc", "START"], False, ""),
        (("STOP",), ["abcS", "TO", "x"], ["abc", "", "STOx"], False, ""),
        (("STOP",), ["S", "S", "S"], ["", "S", "S"], False, "S"),
        # Held back at the end of the stream: flush releases it.
        (("STOP",), ["abcSTO"], ["abc"], False, "STO"),
        (("\n\n",), ["line\n"], ["line"], False, "\n"),
        # The held prefix can restart inside itself ("aab" with stop "ab").
        (("ab",), ["a", "a", "b"], ["", "a", ""], True, ""),
        (("aab",), ["a", "a", "a", "b"], ["", "", "a", ""], True, ""),
        # Multiple stops: the earliest occurrence wins, whichever stop it is.
        (("END", "STOP"), ["xSTOPyEND"], ["x"], True, ""),
        (("END", "STOP"), ["xENDySTOP"], ["x"], True, ""),
        (("END", "STOP"), ["xST", "EN", "D"], ["x", "ST", ""], True, ""),
        # Overlapping stops: hold back the longest possible prefix of any of them.
        (("abc", "bcd"), ["xab", "cd"], ["x", ""], True, ""),
        (("abc", "bcd"), ["xbc", "d"], ["x", ""], True, ""),
        (("abc", "zzbc"), ["qzzb", "x"], ["q", "zzbx"], False, ""),
        # An empty stop string matches nothing.
        (("",), ["abc"], ["abc"], False, ""),
        (("", "c"), ["ab", "cd"], ["ab", ""], True, ""),
        # Single-character stop: nothing needs holding back.
        ((".",), ["a.b"], ["a"], True, ""),
        ((".",), ["ab", "c."], ["ab", "c"], True, ""),
        # Unicode text.
        (("。",), ["你好", "。再见"], ["你好", ""], True, ""),
        (("«fin»",), ["texte «f", "in» plus"], ["texte ", ""], True, ""),
    ],
)
def test_feed_table(
    stops: tuple[str, ...], deltas: list[str], outputs: list[str], hit: bool, flushed: str
) -> None:
    assert run(stops, deltas) == (outputs, hit, flushed)


def test_flush_clears_pending() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abST") == ("ab", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""
    # The held text is gone, so it cannot combine with the next delta into a stop.
    assert matcher.feed("OP") == ("OP", False)


def test_feed_after_a_hit_starts_fresh() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("aSTOPST") == ("a", True)
    # The text after the stop (including a would-be prefix) was dropped.
    assert matcher.flush() == ""
    assert matcher.feed("OP") == ("OP", False)


def test_stop_never_partially_emitted_char_by_char() -> None:
    stops = ("<|im_end|>", "\nUser:")
    text = "Sure! Here is <|im_e the answer.\nUser is fine\nUser: next"
    matcher = StopMatcher(stops)
    emitted, hit = "", False
    for ch in text:
        out, hit = matcher.feed(ch)
        emitted += out
        if hit:
            break
    assert hit
    assert emitted == "Sure! Here is <|im_e the answer.\nUser is fine"


@pytest.mark.parametrize("seed", range(8))
def test_random_splits_match_oracle(seed: int) -> None:
    """Any chunking: output is the fed text cut at the earliest stop start, hit as soon as
    a stop is complete, and only the longest possible partial stop is ever held back."""
    rng = random.Random(seed)
    alphabet = "abc"
    for _ in range(300):
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(0, 3))
        )
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]

        matcher = StopMatcher(stops)
        emitted, fed, hit = "", "", False
        for delta in deltas:
            out, hit = matcher.feed(delta)
            fed += delta
            emitted += out
            want, want_hit = expected_output(stops, fed)
            assert hit == want_hit, (stops, deltas)
            if hit:
                assert emitted == want, (stops, deltas)
                break
            # Nothing emitted yet can belong to a stop: it is a prefix of the text fed.
            assert fed.startswith(emitted), (stops, deltas)
            held = len(fed) - len(emitted)
            longest = max(
                (k for s in stops for k in range(1, len(s)) if fed.endswith(s[:k])),
                default=0,
            )
            assert held == longest, (stops, deltas)
        if not hit:
            assert emitted + matcher.flush() == text
            assert expected_output(stops, text) == (text, False)
