"""Byte tokenizer: exact round trips (ASCII, multi-byte UTF-8, raw bytes), special ids, errors."""
import pytest
from hypothesis import given, settings, strategies as st

from pdjax.workload import byte_tokenizer as tok


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_text_round_trips(text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= t < tok.NUM_BYTES for t in ids)
    assert tok.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_bytes_round_trip(data):
    assert tok.decode_bytes(tok.encode(data, add_bos=True, add_eos=True)) == data


def test_special_ids_wrap_and_are_dropped():
    ids = tok.encode("héllo", add_bos=True, add_eos=True)
    assert ids[0] == tok.BOS_ID == 256 and ids[-1] == tok.EOS_ID == 257
    assert len(ids) == 2 + len("héllo".encode("utf-8")) == 8
    assert tok.decode(ids + [tok.PAD_ID, tok.PAD_ID]) == "héllo"
    assert tok.VOCAB_SIZE == 259 and tok.PAD_ID == 258


def test_invalid_utf8_is_replaced_not_raised():
    assert tok.decode([ord("a"), 0xE9, ord("b")]) == "a\ufffdb"      # a lone Latin-1 byte


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="token id 259 at index 1"):
        tok.decode([65, 259])
    with pytest.raises(ValueError, match="token id -1 at index 0"):
        tok.decode_bytes([-1])
    with pytest.raises(TypeError, match="expected str or bytes, got list"):
        tok.encode([1, 2])
