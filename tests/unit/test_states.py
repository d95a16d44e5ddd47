"""The state vocabularies, one mapping each: session liveness -> lock state -> election state."""

from celery_zklock import LockState
from celery_zklock.recipes.election import LEADER_STATE, ElectionState
from celery_zklock.recipes.lock import HOLD_STATE
from celery_zklock.zk import Liveness


def test_each_liveness_of_the_session_is_one_state_of_a_held_lock():
    assert set(HOLD_STATE) == set(Liveness)
    assert [HOLD_STATE[liveness].value for liveness in Liveness] == [liveness.value for liveness in Liveness]


def test_each_state_of_a_held_lock_is_one_state_of_its_leader_or_a_standby_again():
    assert set(LEADER_STATE) == set(HOLD_STATE.values()) - {LockState.LOST}
    assert set(LEADER_STATE.values()) == {ElectionState.LEADER, ElectionState.SUSPENDED}


def test_states_compare_and_print_as_their_values():
    assert LockState.LOST == "lost" and "lost" == LockState.LOST and LockState.HELD != "lost"
    assert (str(LockState.IN_DOUBT), f"{LockState.IN_DOUBT}", f"{Liveness.IN_DOUBT}") == ("in_doubt",) * 3
    assert LockState.IN_DOUBT.replace("_", " ") == "in doubt"
