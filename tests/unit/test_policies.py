"""The policy values: one class per name the settings know, each checking its own fields."""

import dataclasses

import pytest

from celery_zklock import ConfigurationError, Park, Preempt, Queued, Retry, Skip, Wait
from celery_zklock.conf import CONTENTION_POLICIES, DEDUPE_MODES, TaskDefaults
from celery_zklock.glue.policies import CONTENTION, DEDUPE, contention_policy


def test_every_name_the_settings_know_is_one_policy_class():
    assert tuple(CONTENTION) == CONTENTION_POLICIES
    assert tuple(DEDUPE) == DEDUPE_MODES


def test_a_field_left_to_its_setting_is_read_when_resolved():
    defaults = TaskDefaults(timeout=12.0, park_limit=7, dedupe_ttl=30.0)
    assert Wait().resolved(defaults) == Wait(timeout=12.0)
    assert Wait(timeout=None).resolved(defaults) == Wait(timeout=None)  # None (for ever) is a value, not unset
    assert Park(at_publish=True).resolved(defaults) == Park(limit=7, at_publish=True)
    assert Queued().resolved(defaults).marker_ttl == 30.0


def test_a_policy_is_a_frozen_value():
    policy = Retry(countdown=2)
    assert policy == Retry(countdown=2) and hash(policy) == hash(Retry(countdown=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.countdown = 3  # type: ignore[misc]


@pytest.mark.parametrize("value", [Skip(), Preempt(timeout=0), "raise"])
def test_a_good_policy_passes(value):
    assert contention_policy("on_contention", value) is not None


def test_the_base_class_is_no_policy():
    from celery_zklock.glue.policies import Contention

    with pytest.raises(ConfigurationError, match="on_contention must be a policy"):
        contention_policy("on_contention", Contention())
