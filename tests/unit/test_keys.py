import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_zklock.exceptions import ConfigurationError
from celery_zklock.keys import MAX_NAME, check_path_template, encode_key

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


# -- hostile input: any arguments give a valid, injective key or a clear error -------------------
import datetime  # noqa: E402
import decimal  # noqa: E402
import math  # noqa: E402
import unicodedata  # noqa: E402
import uuid  # noqa: E402

from celery_zklock.exceptions import KeyBuildError  # noqa: E402
from celery_zklock.keys import default_key  # noqa: E402

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
           | st.decimals() | st.uuids() | st.datetimes() | st.dates())
hashables = st.recursive(scalars.filter(lambda v: not isinstance(v, decimal.Decimal) or not v.is_nan()),
                         lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3), max_leaves=6)
arguments = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(hashables, inner, max_size=4) | st.frozensets(hashables, max_size=4)),
    max_leaves=12,
)


def typed(v):
    """What makes two arguments the same lock key: their values *and* types (tuples are lists)."""
    if isinstance(v, (bytes, bytearray)):
        return ("bytes", bytes(v))
    if v is None or isinstance(v, (bool, str, uuid.UUID, datetime.date)):
        return (type(v).__name__, v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, float):
        return ("float", "nan" if math.isnan(v) else repr(v))
    if isinstance(v, decimal.Decimal):
        return ("Decimal", str(v))
    if isinstance(v, (list, tuple)):
        return ("list", tuple(typed(x) for x in v))
    if isinstance(v, dict):
        return ("dict", frozenset((typed(k), typed(x)) for k, x in v.items()))
    return ("set", frozenset(typed(x) for x in v))


def lookalikes(v):
    """Values that print, compare or serialize like ``v``: where a careless encoding collides."""
    out = [str(v), repr(v), [v], (v,), {str(v): None}]
    if isinstance(v, bytes):
        out += [v.decode("latin-1"), v.hex(), {"bytes": v.hex()}, bytearray(v)]
    if isinstance(v, str):
        out += [v.encode(), v.upper(), f'"{v}"']
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        out += [float(v), bool(v), -v, decimal.Decimal(str(v)) if math.isfinite(v) else v]
        if isinstance(v, float) and math.isfinite(v):
            out.append(int(v))
    if isinstance(v, (list, tuple)):
        out += [list(v), tuple(v), list(reversed(v)), ",".join(map(str, v))]
    if isinstance(v, dict):
        out += [list(v.items()), list(v), list(v.values())]
    return out


def check_pair(a, b):
    key_a, key_b = default_key("t.f", {"x": a}), default_key("t.f", {"x": b})
    assert valid_name(encode_key(key_a))
    assert (key_a == key_b) == (typed(a) == typed(b)), (a, b)
    assert (encode_key(key_a) == encode_key(key_b)) == (key_a == key_b)


@settings(max_examples=300, deadline=None)
@given(arguments, arguments)
def test_default_keys_of_any_arguments_are_valid_and_injective(a, b):
    check_pair(a, b)
    for other in lookalikes(a):
        check_pair(a, other)


@pytest.mark.parametrize("a, b", [(1, "1"), (1, 1.0), (1, True), (0.0, -0.0), (b"1", "1"), (b"hi", {"bytes": "6869"}),
                                  ({1: "a"}, {"1": "a"}), ([1, 2], {1, 2}), (None, "null"), ("a,b", ["a", "b"])])
def test_lookalike_arguments_get_distinct_keys(a, b):
    assert default_key("t.f", {"x": a}) != default_key("t.f", {"x": b})


def test_mixed_key_types_and_tuples_as_lists():
    assert default_key("t.f", {"x": {1: "a", "b": 2}})  # no TypeError from sorting mixed keys
    assert default_key("t.f", {"x": (1, 2)}) == default_key("t.f", {"x": [1, 2]})  # JSON delivers tuples as lists


@pytest.mark.parametrize("value", [object(), lambda: 1, Exception("x")])
def test_arguments_without_a_stable_rendering_are_a_clear_error(value):
    with pytest.raises(KeyBuildError, match="task t.f: argument value of type .* give key="):
        default_key("t.f", {"x": value})


def test_self_containing_arguments_are_a_clear_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(KeyBuildError, match="nest too deeply"):
        default_key("t.f", {"x": loop})


def _variants(s):
    yield s.swapcase()
    yield s.upper()
    yield unicodedata.normalize("NFD", s)
    yield unicodedata.normalize("NFKC", s)
    for a, b in (("/", "%2F"), ("/", ":"), (":", "-"), ("-", "_"), (".", "%2E"), (" ", "+")):
        yield s.replace(a, b)
    yield s + "/"
    yield "x" * 300 + s  # same long prefix...
    yield "x" * 300 + s + "."  # ...differing only past it


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("aAbB/:%-_. é\u0301\ufb01Å\u212b"), max_size=12))
def test_case_normalisation_separator_and_length_variants_never_share_a_node(s):
    for v in _variants(s):
        if v != s:
            assert encode_key(v) != encode_key(s), (s, v)
    assert encode_key("x" * 300 + s) != encode_key("x" * 300 + s + ".")


def test_hashed_names_are_hmacs_that_reveal_nothing_and_differ_per_secret():
    from celery_zklock.layout import Layout, hashed_name

    a, b = Layout("/r", secret=b"0123456789abcdef"), Layout("/r", secret=b"fedcba9876543210")
    name = a.name("user:alice@example.com")
    assert name.startswith("s-") and len(name) == 66 and "alice" not in name
    assert name == hashed_name(b"0123456789abcdef", "user:alice@example.com") != b.name("user:alice@example.com")
    assert a.name("user:42") != a.name("user:43")
    assert a.label("user:42") == a.name("user:42") and Layout("/r").label("user:42") == "user:42"
    # The scheme tells readable from hashed, and one secret from another, without revealing it.
    assert Layout("/r").scheme == "readable"
    assert a.scheme.startswith("hashed:") and a.scheme != b.scheme and "0123" not in a.scheme


@pytest.mark.parametrize(("template", "fn"), [("x/{a}", lambda a: None), ("/x/{a}/", lambda a: None),
                                              ("/x//{a}", lambda a: None), ("billing/{key}", None)])
def test_a_wrong_path_template_is_quoted_as_written(template, fn):
    # It was quoted with each field as "x" ('x/x' for 'x/{a}'): a path the user never wrote.
    with pytest.raises(ConfigurationError) as caught:
        check_path_template(template, fn, "task t")
    assert str(caught.value).startswith(f"task t: path={template!r} must be an absolute znode path"), caught.value
