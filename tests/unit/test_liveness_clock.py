"""LivenessClock, table-driven, with no server: when do a session's nodes count as lost?"""

from __future__ import annotations

import pytest

from celery_zklock.zk.clock import HEARTBEATS_PER_TIMEOUT, LOSS_MARGIN, Liveness, LivenessClock

T = 10.0  # configured session timeout
LOST_AFTER = T * (1 - LOSS_MARGIN)  # 9.0 s of silence

HELD, IN_DOUBT, LOST = Liveness.HELD, Liveness.IN_DOUBT, Liveness.LOST


def run(events):
    """Feed (time, event, *args) to a fresh clock; return it."""
    clock = LivenessClock(T)
    for now, event, *args in events:
        if event == "connected":
            clock.connected(now, *args)
        elif event == "answered":  # (reply time, event, send time)
            clock.answered(args[0], connected=True)
        elif event == "answered_while_down":
            clock.answered(args[0], connected=False)
        elif event == "suspended":
            clock.suspended(now)
        elif event == "expired":
            clock.expired(now)
        elif event == "tick":
            clock.tick(now)
        else:  # pragma: no cover - a typo in the table
            raise AssertionError(event)
    return clock


START = [(0.0, "connected", 1), (0.0, "answered", 0.0)]

CASES = {
    # name: (events after START, time asked, expected liveness, expected generation)
    "fresh": ([], 1.0, HELD, 0),
    "silent, just before the margin": ([], LOST_AFTER - 1e-9, HELD, 0),
    "silent, exactly at the margin": ([], LOST_AFTER, LOST, 0),
    "reply counts from its send time, not its arrival": (
        [(8.5, "answered", 2.0)], 2.0 + LOST_AFTER, LOST, 0),
    "reply sent just before the margin extends it": (
        [(8.999, "answered", 8.99)], 8.99 + LOST_AFTER - 0.001, HELD, 0),
    "an older reply never moves the clock back": (
        [(5.0, "answered", 4.0), (5.1, "answered", 1.0)], 4.0 + LOST_AFTER - 0.001, HELD, 0),
    "suspended: in doubt": ([(3.0, "suspended")], 4.0, IN_DOUBT, 0),
    "suspended past the margin: lost": ([(3.0, "suspended")], LOST_AFTER, LOST, 0),
    "suspended then connected to the same session: held again": (
        [(3.0, "suspended"), (4.0, "connected", 1)], 5.0, HELD, 0),
    "suspended then connected to a new session: a new generation": (
        [(3.0, "suspended"), (4.0, "connected", 2)], 5.0, HELD, 1),
    "kazoo said LOST": ([(3.0, "expired")], 3.5, LOST, 1),
    "the clock ran out (tick)": ([(LOST_AFTER, "tick")], LOST_AFTER, LOST, 1),
    "a tick before the margin does nothing": ([(LOST_AFTER - 0.01, "tick")], LOST_AFTER - 0.01, HELD, 0),
    "revived by a reply sent after the loss, same generation kept lost": (
        [(LOST_AFTER, "tick"), (9.5, "answered", 9.2)], 9.6, HELD, 1),
    "not revived by a reply sent before the loss": (
        [(LOST_AFTER, "tick"), (9.5, "answered", 8.0)], 9.6, LOST, 1),
    "not revived while kazoo is disconnected": (
        [(LOST_AFTER, "tick"), (9.5, "answered_while_down", 9.2)], 9.6, LOST, 1),
    "expired twice counts once": ([(3.0, "expired"), (3.1, "expired")], 3.2, LOST, 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_liveness(name):
    events, now, expected, generation = CASES[name]
    clock = run(START + events)
    assert clock.liveness(now) == expected
    assert clock.generation == generation


def test_a_reconnect_counts_as_an_answer_one_heartbeat_old():
    clock = run(START + [(5.0, "suspended"), (100.0, "connected", 1)])
    assert clock.last_answer == pytest.approx(100.0 - T / HEARTBEATS_PER_TIMEOUT)
    reconnect_lost_after = 100.0 - T / HEARTBEATS_PER_TIMEOUT + LOST_AFTER
    assert clock.liveness(reconnect_lost_after - 0.001) == HELD
    assert clock.liveness(reconnect_lost_after) == LOST


@pytest.mark.parametrize("negotiated, lost_after", [(4.0, 4.0 * (1 - LOSS_MARGIN)), (20.0, LOST_AFTER)])
def test_the_shorter_of_configured_and_negotiated_timeout_applies(negotiated, lost_after):
    clock = LivenessClock(T)
    clock.connected(0.0, 1, negotiated_timeout=negotiated)
    clock.answered(0.0, connected=True)
    assert clock.timeout == min(T, negotiated)
    assert clock.liveness(lost_after - 1e-9) == HELD
    assert clock.liveness(lost_after) == LOST


@pytest.mark.parametrize("events, changed", [
    ([(0.0, "connected", 1)], True),  # first connect
    ([(0.0, "connected", 1), (1.0, "connected", 1)], False),  # nothing new
])
def test_connected_reports_a_change_only_once(events, changed):
    clock = LivenessClock(T)
    results = [clock.connected(now, *args) for now, _, *args in events]
    assert results[-1] is changed


def test_events_report_changes():
    clock = run(START)
    assert clock.suspended(1.0) is True
    assert clock.suspended(1.1) is False
    assert clock.expired(2.0) is True
    assert clock.tick(50.0) is False  # already lost: no second generation


def test_heartbeat_interval_never_sleeps_past_the_margin():
    clock = run(START)
    assert clock.heartbeat_interval(0.0) == pytest.approx(T / HEARTBEATS_PER_TIMEOUT)
    assert clock.heartbeat_interval(LOST_AFTER - 0.5) == pytest.approx(0.5)
    assert clock.heartbeat_interval(LOST_AFTER + 5) == 0.005  # never negative or zero


@pytest.mark.parametrize("timeout, margin", [(0, 0.1), (-1, 0.1), (10, 1.0), (10, -0.1)])
def test_bad_parameters(timeout, margin):
    with pytest.raises(ValueError):
        LivenessClock(timeout, margin)

