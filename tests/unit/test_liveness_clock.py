"""LivenessClock, table-driven, with no server: when do a session's nodes count as lost?"""

from __future__ import annotations

import pytest

from celery_zklock.zk.clock import LOSS_MARGIN, Liveness, LivenessClock

T = 10.0  # configured session timeout
TICK = 1.0  # the server's tickTime: how long an answer waits to become proof
LOST_AFTER = T * (1 - LOSS_MARGIN)  # 9.0 s without proof

HELD, IN_DOUBT, LOST = Liveness.HELD, Liveness.IN_DOUBT, Liveness.LOST


def run(events, tick=TICK):
    """Feed (time, event, *args) to a fresh clock; return it."""
    clock = LivenessClock(T, tick=tick)
    for now, event, *args in events:
        if event == "connected":  # (time, event, session id, connect send time)
            clock.connected(now, *args)
        elif event == "answered":  # (reply time, event, send time)
            clock.answered(args[0], now, connected=True)
        elif event == "answered_while_down":
            clock.answered(args[0], now, connected=False)
        elif event == "suspended":
            clock.suspended(now)
        elif event == "expired":
            clock.expired(now)
        elif event == "tick":
            clock.tick(now)
        else:  # pragma: no cover - a typo in the table
            raise AssertionError(event)
    return clock


START = [(0.0, "connected", 1, 0.0)]  # a new session, asked for at 0.0: proof at once

CASES = {
    # name: (events after START, time asked, expected liveness, expected generation)
    "fresh": ([], 1.0, HELD, 0),
    "silent, just before the margin": ([], LOST_AFTER - 1e-9, HELD, 0),
    "silent, exactly at the margin": ([], LOST_AFTER, LOST, 0),
    "a lone answer is no proof (a follower cut from the leader answers too)": (
        [(2.1, "answered", 2.0)], LOST_AFTER, LOST, 0),
    "an answer becomes proof when one sent a tick after it is answered": (
        [(2.1, "answered", 2.0), (3.2, "answered", 3.1)], 2.0 + LOST_AFTER - 1e-9, HELD, 0),
    "proof counts from its send time, not its arrival": (
        [(2.5, "answered", 2.0), (3.6, "answered", 3.5)], 2.0 + LOST_AFTER, LOST, 0),
    "one sent less than a tick after is no witness": (
        [(2.1, "answered", 2.0), (3.0, "answered", 2.9)], LOST_AFTER, LOST, 0),
    "the witness itself waits for its own": (
        [(2.1, "answered", 2.0), (3.2, "answered", 3.1)], 3.1 + LOST_AFTER - 0.5, LOST, 0),
    "an older answer never moves the clock back": (
        [(5.0, "answered", 4.0), (6.1, "answered", 6.0), (6.2, "answered", 1.0), (7.5, "answered", 7.4)],
        4.0 + LOST_AFTER - 0.001, HELD, 0),
    "suspended: in doubt": ([(3.0, "suspended")], 4.0, IN_DOUBT, 0),
    "suspended past the margin: lost": ([(3.0, "suspended")], LOST_AFTER, LOST, 0),
    "suspended then connected to the same session: held again": (
        [(3.0, "suspended"), (4.0, "connected", 1, 3.5)], 5.0, HELD, 0),
    "a reconnect is an answer like any other (its leader may be deposed)": (
        [(3.0, "suspended"), (4.0, "connected", 1, 3.5)], LOST_AFTER, LOST, 0),
    "a reconnect counts from the request, once a heartbeat a tick later is answered": (
        [(3.0, "suspended"), (7.2, "connected", 1, 3.5), (8.4, "answered", 8.3)], 3.5 + LOST_AFTER - 1e-9, HELD, 0),
    "suspended then connected to a new session: a new generation": (
        [(3.0, "suspended"), (4.0, "connected", 2, 3.5)], 5.0, HELD, 1),
    "a new session is proof from its request at once: a quorum created it": (
        [(3.0, "suspended"), (4.0, "connected", 2, 3.5)], 3.5 + LOST_AFTER - 1e-9, HELD, 1),
    "a connect whose send time is unknown proves nothing": (
        [(3.0, "suspended"), (4.0, "connected", 2)], LOST_AFTER, LOST, 1),
    "kazoo said LOST": ([(3.0, "expired")], 3.5, LOST, 1),
    "the clock ran out (tick)": ([(LOST_AFTER, "tick")], LOST_AFTER, LOST, 1),
    "a tick before the margin does nothing": ([(LOST_AFTER - 0.01, "tick")], LOST_AFTER - 0.01, HELD, 0),
    "revived by proof sent after the loss, same generation kept lost": (
        [(LOST_AFTER, "tick"), (9.5, "answered", 9.2), (10.5, "answered", 10.5)], 10.6, HELD, 1),
    "not revived by a lone answer sent after the loss": (
        [(LOST_AFTER, "tick"), (9.5, "answered", 9.2)], 9.6, LOST, 1),
    "not revived by proof sent before the loss": (
        [(8.1, "answered", 8.0), (LOST_AFTER, "tick"), (9.5, "answered", 9.2)], 9.6, LOST, 1),
    "not revived while kazoo is disconnected": (
        [(LOST_AFTER, "tick"), (9.5, "answered", 9.2), (10.6, "answered_while_down", 10.5)], 10.6, LOST, 1),
    "expired twice counts once": ([(3.0, "expired"), (3.1, "expired")], 3.2, LOST, 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_liveness(name):
    events, now, expected, generation = CASES[name]
    clock = run(START + events)
    assert clock.liveness(now) == expected
    assert clock.generation == generation


def test_without_a_known_tick_the_lag_is_half_the_timeout():
    # ZooKeeper grants no session shorter than two ticks unless minSessionTimeout is lowered.
    clock = run(START + [(2.1, "answered", 2.0), (6.9, "answered", 6.8)], tick=None)
    assert clock.lag == T / 2 and clock.last_answer == 0.0
    clock.answered(7.2, 7.3)
    assert clock.last_answer == 2.0


@pytest.mark.parametrize("negotiated, lost_after", [(4.0, 4.0 * (1 - LOSS_MARGIN)), (20.0, LOST_AFTER)])
def test_the_shorter_of_configured_and_negotiated_timeout_applies(negotiated, lost_after):
    clock = LivenessClock(T)
    clock.negotiated_timeout = negotiated
    clock.connected(0.0, 1, sent=0.0)
    assert clock.timeout == min(T, negotiated)
    assert clock.liveness(lost_after - 1e-9) == HELD
    assert clock.liveness(lost_after) == LOST


@pytest.mark.parametrize("events, changed", [
    ([(0.0, "connected", 1, 0.0)], True),  # first connect
    ([(0.0, "connected", 1, 0.0), (1.0, "connected", 1, 0.9)], False),  # nothing new
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
    assert clock.heartbeat_interval(0.0) == pytest.approx(TICK / 2)  # proof never older than two ticks
    # A long lag leaves less time between heartbeats: a quarter of what the margin leaves after it.
    assert run(START, tick=None).heartbeat_interval(0.0) == pytest.approx((LOST_AFTER - T / 2) / 4)
    assert run(START, tick=0.01).heartbeat_interval(0.0) == pytest.approx(T / 20)  # never a busy loop
    assert clock.heartbeat_interval(LOST_AFTER - 0.2) == pytest.approx(0.2)
    assert clock.heartbeat_interval(LOST_AFTER + 5) == 0.005  # never negative or zero


@pytest.mark.parametrize("timeout, margin, tick", [(0, 0.1, None), (-1, 0.1, None), (10, 1.0, None),
                                                   (10, -0.1, None), (10, 0.1, 0)])
def test_bad_parameters(timeout, margin, tick):
    with pytest.raises(ValueError):
        LivenessClock(timeout, margin, tick)

