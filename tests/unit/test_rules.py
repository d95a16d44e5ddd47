import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_zklock.recipes.rules import (
    EXCLUSIVE,
    READ,
    RULES,
    WRITE,
    Decision,
    contender,
    semaphore,
    sequence,
    split_queue,
)


def n(kind: str, seq: int, who: str = "u") -> str:
    return f"{who}{seq:x}__{kind}__{seq:010d}"


def test_exclusive_watches_only_its_predecessor():
    kids = [n("lock", 3), n("lock", 1), n("rlock", 2), n("lock", 4)]
    assert EXCLUSIVE.decide(kids, n("lock", 1)) == Decision(True, (), False)
    assert EXCLUSIVE.decide(kids, n("lock", 4)) == Decision(False, (n("lock", 3),), False)
    assert EXCLUSIVE is WRITE


def test_reader_waits_for_last_earlier_writer_only():
    kids = [n("rlock", 1), n("lock", 2), n("rlock", 3), n("lock", 4), n("rlock", 5)]
    assert READ.decide(kids, n("rlock", 1)).holds
    assert READ.decide(kids, n("rlock", 3)) == Decision(False, (n("lock", 2),), False)
    assert READ.decide(kids, n("rlock", 5)) == Decision(False, (n("lock", 4),), False)
    assert READ.decide([n("rlock", 1), n("rlock", 2)], n("rlock", 2)).holds


def test_junk_children_never_block():
    kids = ["garbage", "x__lock__12", "__lock__abcdefghij", n("lock", 7)]
    assert EXCLUSIVE.decide(kids, n("lock", 7)).holds


def test_semaphore_first_waiter_watches_every_holder():
    sem = semaphore(2)
    kids = [n("sem", i) for i in range(1, 6)]
    assert sem.decide(kids, n("sem", 2)).holds
    assert sem.decide(kids, n("sem", 3)) == Decision(False, (n("sem", 1), n("sem", 2)), False)
    assert sem.decide(kids, n("sem", 5)) == Decision(False, (n("sem", 4),), True)


def test_sequence_sort_is_numeric_across_kinds():
    assert EXCLUSIVE.decide([n("lock", 10), n("rlock", 9)], n("lock", 10)).watch == (n("rlock", 9),)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_semaphore_limit_validation(bad):
    with pytest.raises(ValueError, match="limit"):
        semaphore(bad)


@given(kinds=st.lists(st.sampled_from(["__lock__", "__rlock__", "__sem__", "junk"]), max_size=40),
       limit=st.integers(min_value=1, max_value=4), seed=st.randoms())
def test_split_queue_agrees_with_each_nodes_own_decision(kinds, limit, seed):
    """split_queue counts in one pass what each contender's ``decide`` finds on its own."""
    children = [f"n{i}" if kind == "junk" else f"u{i}{kind}{i:010d}" for i, kind in enumerate(kinds)]
    seed.shuffle(children)  # as the server lists them: in no order
    rules = {**RULES, "__sem__": semaphore(limit)}
    holders, waiters = split_queue(children, rules.__getitem__)
    nodes = sorted((c for c in children if contender(c)), key=sequence)
    assert holders == [n for n in nodes if rules[contender(n)[0]].decide(children, n).holds]
    assert waiters == [n for n in nodes if not rules[contender(n)[0]].decide(children, n).holds]
