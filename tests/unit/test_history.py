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


def test_the_dedupe_check_keeps_a_copy_queued_through_its_retries_for_a_lock():
    # The fault-rig trial: a queued copy retrying for a held lock past its marker's life let
    # a second copy queue beside it, and the check (ending the span at the first
    # task_prerun) saw nothing.
    from harness.dedupe import dedupe_violations

    publishes = [{"key": "k", "t0": 0, "t1": 1, "marked": 0.5, "asked": "x", "got": "x"},
                 {"key": "k", "t0": 5, "t1": 6, "marked": 5.5, "asked": "y", "got": "y"}]
    runs = [{"event": e, "time": t, "task_id": i} for e, t, i in (
        ("pre", 2, "x"), ("pre", 4, "x"), ("pre", 8, "x"), ("start", 8, "x"), ("end", 9, "x"),
        ("pre", 10, "y"), ("start", 10, "y"), ("end", 11, "y"))]
    assert dedupe_violations(publishes, runs, "queued") == ["key 'k': copies x and y queued at once"]
    runs_in_turn = [r for r in runs if r["task_id"] == "x"] + [
        {"event": e, "time": t + 8, "task_id": "y"} for e, t in (("pre", 2), ("start", 2), ("end", 3))]
    publishes[1].update(t0=8.5, t1=8.6, marked=8.55)
    assert dedupe_violations(publishes, runs_in_turn, "queued") == []


def test_the_dedupe_check_takes_a_copy_that_failed_unstarted_for_no_stray_run():
    # The dedupe fuzzer's seed 3596: a copy never sent, whose result says so ("failed"),
    # was reported as a copy that "ran but no publish returned it as a new copy".
    from harness.dedupe import dedupe_violations

    publishes = [{"key": "k", "t0": 0, "t1": 1, "marked": None, "asked": "x", "got": None},
                 {"key": "k", "t0": 2, "t1": 3, "marked": None, "asked": "y", "got": "x"}]
    assert dedupe_violations(publishes, [{"event": "failed", "time": 4, "task_id": "x"}], "queued_or_running") == []
    assert dedupe_violations(publishes, [], "queued_or_running") == [
        "publish at 2.000 of key 'k' returned x, which never ran"]
