"""The checker must catch what it is there to catch, or every concurrency test is hollow."""

from celery_zklock.testing import Hold, max_concurrency, violations


def test_clean_history_passes():
    h = [Hold("k", "exclusive", 1, 0, 1, "a"), Hold("k", "exclusive", 2, 1, 2, "b"),
         Hold("k", "read", 3, 2, 4, "r1"), Hold("k", "read", 4, 2.5, 3, "r2")]
    assert violations(h) == []
    assert max_concurrency(h, "k") == 2


def test_overlap_and_token_order_are_caught():
    assert violations([Hold("k", "exclusive", 1, 0, 2, "a"), Hold("k", "exclusive", 2, 1, 3, "b")])
    assert violations([Hold("k", "write", 5, 0, 1, "a"), Hold("k", "write", 4, 1, 2, "b")])
    assert violations([Hold("k", "write", 1, 0, 2, "w"), Hold("k", "read", 2, 1, 3, "r")])
    assert violations([Hold("k", "semaphore", i, 0, 1, str(i), limit=2) for i in range(3)])
    assert not violations([Hold("k", "semaphore", i, 0, 1, str(i), limit=2) for i in range(2)])
