import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_zklock.keys import MAX_NAME, encode_key

# What ZooKeeper accepts in a node name (PathUtils.validatePath), minus '/'.
_FORBIDDEN = re.compile("[\u0000-\u001f\u007f-\u009f\ud800-\uf8ff\ufff0-\uffff/]")


def valid_name(name: str) -> bool:
    return name not in ("", ".", "..") and not _FORBIDDEN.search(name) and len(name) <= MAX_NAME + 80


AWKWARD = ["", ".", "..", "/", "a/b", "../..", "é", "\x00", "\n\t", "%", "%25", "x" * 10_000, "zookeeper"]


@pytest.mark.parametrize("key", AWKWARD)
def test_awkward_keys_give_valid_names(key):
    assert valid_name(encode_key(key))


def test_readable_and_distinct():
    assert encode_key("invoice:42") == "k-invoice:42"
    assert encode_key("a/b") != encode_key("a%2Fb")
    assert encode_key("A") != encode_key("a")
    assert encode_key("\u00e9") != encode_key("e\u0301")  # no unicode normalisation


def test_long_keys_keep_a_prefix_and_differ_past_it():
    a, b = "x" * 5000 + "a", "x" * 5000 + "b"
    assert encode_key(a).startswith("h-xxxxxxxx")
    assert encode_key(a) != encode_key(b)
    assert len(encode_key(a)) <= MAX_NAME


def test_non_string_key_is_a_type_error():
    with pytest.raises(TypeError, match="key must be a str"):
        encode_key(42)  # type: ignore[arg-type]


@settings(max_examples=500)
@given(st.text(), st.text())
def test_injective_and_valid(a, b):
    assert valid_name(encode_key(a))
    if a != b:
        assert encode_key(a) != encode_key(b)


@given(st.text(min_size=1).map(lambda s: s * 200))
def test_long_forms_are_valid(key):
    assert valid_name(encode_key(key))
