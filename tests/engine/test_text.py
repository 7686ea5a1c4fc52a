"""``Text``: a request's text appended in pieces, read as the str it stands for."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton.engine.outputs import CompletionOutput, Prefix, Text

PIECES = st.lists(st.text(max_size=6), max_size=40)


@given(pieces=PIECES, fold=st.integers(1, 5), data=st.data())
def test_text_reads_as_the_concatenation_of_its_pieces(pieces, fold, data):
    """Whatever the pieces (empty ones too) and however often they fold, the text, its
    length, every ``since`` and every earlier ``Prefix`` read as plain str
    concatenation would; a cut keeps the first characters and appends go on after it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Text, "FOLD", fold)
        _check_text(pieces, data)


def _check_text(pieces: list[str], data) -> None:
    text, reference, prefixes = Text(), "", []
    for piece in pieces:
        text.append(piece)
        reference += piece
        prefixes.append((Prefix(text), reference))
        assert len(text) == len(reference)
        start = data.draw(st.integers(0, len(reference)))
        assert text.since(start) == reference[start:]
    assert str(text) == reference
    for prefix, expected in prefixes:
        assert prefix.copy() == expected
    with pytest.raises(IndexError, match=str(len(reference) + 1)):
        text.since(len(reference) + 1)
    cut = data.draw(st.integers(0, len(reference)))
    text.cut(cut)
    text.append("tail")
    assert str(text) == reference[:cut] + "tail" and len(text) == cut + 4
    assert text.since(cut) == "tail"


def test_a_text_prefix_refuses_a_text_cut_below_it():
    text = Text("hello world")
    prefix = Prefix(text)
    text.cut(5)
    with pytest.raises(AssertionError, match="cut below"):
        prefix.copy()


def test_completion_output_reads_a_text_prefix_as_str_once():
    text = Text("ab")
    out = CompletionOutput(index=0, text=Prefix(text, 2), token_ids=[1, 2])
    text.append("cd")
    assert type(out.text) is str and out.text == "ab"
    assert out.text is out.text  # joined once
    assert out == CompletionOutput(index=0, text="ab", token_ids=[1, 2])
    assert pickle.loads(pickle.dumps(out)) == out
