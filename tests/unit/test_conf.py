import pytest

from celery_zklock.conf import Settings
from celery_zklock.exceptions import ConfigurationError


def test_defaults():
    s = Settings.from_conf({})
    assert (s.hosts, s.root, s.session_timeout, s.connect_timeout, s.auth) == (
        "127.0.0.1:2181", "/celery-zklock", 10.0, 15.0, None)


@pytest.mark.parametrize("name, value", [
    ("zklock_hosts", ""), ("zklock_hosts", "host:99999"), ("zklock_hosts", "a b:1"), ("zklock_hosts", 5),
    ("zklock_root", "relative"), ("zklock_root", "/"), ("zklock_root", "/a/"), ("zklock_root", "/a//b"),
    ("zklock_root", "/a/../b"),
    ("zklock_session_timeout", 0), ("zklock_session_timeout", -1), ("zklock_session_timeout", "10"),
    ("zklock_session_timeout", float("nan")), ("zklock_connect_timeout", True),
    ("zklock_auth", "nocolon"), ("zklock_auth", ":pw"),
    ("zklock_server_tick_time", 0), ("zklock_server_tick_time", "2"), ("zklock_server_tick_time", 5.5),
])
def test_bad_values_name_the_setting(name, value):
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_conf({name: value})


def test_the_server_tick_is_at_most_half_the_session_timeout():
    assert Settings.from_conf({"zklock_server_tick_time": 2}).server_tick_time == 2.0
    assert Settings.from_conf({}).server_tick_time is None  # the clock assumes half the session timeout
    with pytest.raises(ConfigurationError, match="zklock_server_tick_time=3 is more than half of "
                                                 "zklock_session_timeout=4"):
        Settings.from_conf({"zklock_server_tick_time": 3, "zklock_session_timeout": 4})
    for wrong in (0, -1, "2", True):  # one message, whatever the wrong value
        with pytest.raises(ConfigurationError, match=r"^zklock_server_tick_time must be None or a positive number "
                                                     r"of seconds, not "):
            Settings.from_conf({"zklock_server_tick_time": wrong})
    with pytest.raises(ConfigurationError, match=r"it is in seconds: zoo.cfg's tickTime=2000 is 2\)$"):
        Settings.from_conf({"zklock_server_tick_time": 2000})


def test_password_is_never_shown():
    s = Settings.from_conf({"zklock_auth": "alice:s3cret"})
    assert s.auth == ("alice", "s3cret")
    assert "s3cret" not in repr(s)
    with pytest.raises(ConfigurationError) as err:
        Settings.from_conf({"zklock_auth": "s3cret-without-user"})
    assert "s3cret" not in str(err.value)


def test_chroot_and_ipv6_hosts():
    assert Settings.from_conf({"zklock_hosts": "a:1,[::1]:2/app"}).hosts == "a:1,[::1]:2/app"


@pytest.mark.parametrize("conf, name", [
    ({"zklock_acl": "creatr"}, "zklock_acl"),
    ({"zklock_acl": "creator"}, "zklock_acl"),  # without zklock_auth
    ({"zklock_use_ssl": "yes"}, "zklock_use_ssl"),
    ({"zklock_use_ssl": True, "zklock_verify_certs": 0}, "zklock_verify_certs"),
    ({"zklock_use_ssl": True, "zklock_ca": "/nonexistent/ca.pem"}, "zklock_ca"),
    ({"zklock_ca": __file__}, "zklock_ca"),  # without zklock_use_ssl
    ({"zklock_use_ssl": True, "zklock_certfile": __file__}, "zklock_certfile and zklock_keyfile"),
    ({"zklock_use_ssl": True, "zklock_keyfile": 7}, "zklock_keyfile"),
])
def test_bad_security_settings_name_the_setting(conf, name):
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_conf(conf)


def test_security_settings():
    s = Settings.from_conf({"zklock_auth": "u:p", "zklock_acl": "creator", "zklock_use_ssl": True,
                            "zklock_ca": __file__, "zklock_certfile": __file__, "zklock_keyfile": __file__,
                            "zklock_verify_certs": False})
    assert (s.acl, s.use_ssl, s.ca, s.certfile, s.keyfile, s.verify_certs) == (
        "creator", True, __file__, __file__, __file__, False)


def test_credentials_in_the_connect_string_are_refused_unshown():
    with pytest.raises(ConfigurationError, match="zklock_hosts") as err:
        Settings.from_conf({"zklock_hosts": "alice:s3cret@zk1:2181"})
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("conf, message", [
    ({"zklock_key_names": "hashed"}, "zklock_key_names='hashed' needs zklock_key_secret"),
    ({"zklock_key_names": "hashed", "zklock_key_secret": "short-s3cret"},
     "zklock_key_secret must be a str or bytes of at least 16 bytes"),
    ({"zklock_key_secret": "long-enough-s3cret-value"}, "zklock_key_secret is set but zklock_key_names is 'readable'"),
    ({"zklock_key_names": "hash"}, "zklock_key_names must be one of readable, hashed"),
    ({"zklock_acl": "private"}, "zklock_acl='private' needs zklock_auth"),
])
def test_key_name_and_private_acl_settings_fail_in_one_line_without_the_secret(conf, message):
    with pytest.raises(ConfigurationError, match=message) as err:
        Settings.from_conf(conf)
    assert "s3cret" not in str(err.value)


def test_the_key_secret_is_never_shown():
    s = Settings.from_conf({"zklock_key_names": "hashed", "zklock_key_secret": "long-enough-s3cret-value"})
    assert s.key_secret == b"long-enough-s3cret-value" and "s3cret" not in repr(s)
    from celery_zklock.conf import describe
    assert "s3cret" not in "\n".join(describe({"zklock_key_secret": "long-enough-s3cret-value"}))


@pytest.mark.parametrize("name", ["ZKLOCK_HOSTS", "Zklock_Hosts", "celery_zklock_hosts", "CELERY_ZKLOCK_HOSTS"])
def test_a_setting_spelt_so_that_it_is_never_read_is_an_error(name):
    # Celery reads zklock_hosts; without Django's CELERY namespace none of these reaches it,
    # and the app would silently lock on the default ZooKeeper.
    with pytest.raises(ConfigurationError, match=rf"setting '{name}' is never read under that spelling; "
                                                 r"zklock settings are lowercase: 'zklock_hosts'"):
        Settings.from_conf({name: "zk:2181"})


def test_the_django_namespace_spelling_is_read():
    from celery import Celery

    app = Celery("django", set_as_current=False)
    app.config_from_object({"CELERY_ZKLOCK_HOSTS": "zk:2181"}, namespace="CELERY")
    assert Settings.from_conf(app.conf).hosts == "zk:2181"


PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIBs3cret\n-----END PRIVATE KEY-----\n"


@pytest.mark.parametrize("name, value", [
    ("zklock_hosts", "admin:s3cret@zk1:2181"), ("zklock_hosts", ["admin:s3cret@zk1:2181"]),
    ("zklock_hosts", b"admin:s3cret@zk1:2181"),
    ("zklock_auth", "app:s3cret"), ("zklock_auth", "s3cret-without-user"), ("zklock_auth", ":s3cret"),
    ("zklock_auth", ("app", "s3cret")),
    ("zklock_key_secret", "s3cret-s3cret-s3cret"), ("zklock_key_secret", b"s3cret"), ("zklock_key_secret", "s3cret"),
    ("zklock_keyfile", PEM_KEY), ("zklock_certfile", PEM_KEY), ("zklock_ca", PEM_KEY), ("zklock_keyfile", [PEM_KEY]),
])
def test_no_value_that_can_hold_a_secret_is_shown_or_echoed(name, value):
    """Wrong or right, in the listing check prints and in the error: never the secret."""
    from celery_zklock.conf import SECRET_SETTINGS, describe, shown

    assert name in SECRET_SETTINGS
    assert "s3cret" not in shown(name, value)
    assert "s3cret" not in "\n".join(describe({name: value}))
    try:
        Settings.from_conf({name: value, "zklock_use_ssl": True})
    except ConfigurationError as exc:
        assert "s3cret" not in str(exc)


def test_what_is_no_secret_is_shown_as_it_is():
    from celery_zklock.conf import describe, shown

    assert shown("zklock_hosts", "zk1:2181,zk2:2181/app") == "'zk1:2181,zk2:2181/app'"
    assert shown("zklock_hosts", "admin:s3cret@zk1:2181,zk2:2181") == "'***@zk1:2181,zk2:2181'"
    assert shown("zklock_auth", "app:s3cret") == "'app:***'"
    assert shown("zklock_keyfile", "/etc/zk/client.key") == "'/etc/zk/client.key'"  # a path; its contents are not
    assert shown("zklock_session_timeout", "10s") == "'10s'"
    assert "zklock_auth = None  (default)" in describe({})


def test_every_wrong_setting_is_named_at_once():
    with pytest.raises(ConfigurationError) as err:
        Settings.from_conf({"zklock_session_timeout": "10s", "zklock_acl": "closed", "zklock_hostz": "zk:2181",
                            "zklock_keyfile": "/nonexistent.key"})
    assert err.value.problems == (
        "unknown setting 'zklock_hostz'; did you mean 'zklock_hosts'?",
        "zklock_session_timeout must be a positive number of seconds, not '10s'",
        "zklock_acl must be one of open, creator, private, not 'closed'",
        "zklock_keyfile names '/nonexistent.key', which is not a readable file",
    )
    assert str(err.value) == "\n".join(err.value.problems)


def test_settings_wrong_together_are_named_at_once_and_one_wrong_alone_is_not_judged_again(tmp_path):
    key = tmp_path / "k.pem"
    key.write_text("x")
    with pytest.raises(ConfigurationError) as err:
        Settings.from_conf({"zklock_acl": "creator", "zklock_key_names": "hashed", "zklock_keyfile": str(key)})
    assert err.value.problems == (
        "zklock_acl='creator' needs zklock_auth: ZooKeeper ties it to a credential",
        "zklock_key_names='hashed' needs zklock_key_secret: the names are HMACs under it, and a plain hash of a key "
        "like 'user:42' can be reversed",
        "zklock_keyfile is set but zklock_use_ssl is False; set zklock_use_ssl=True",
        "zklock_certfile and zklock_keyfile must be set together",
    )
    with pytest.raises(ConfigurationError) as err:  # the wrong key_names is not also "needs a secret"
        Settings.from_conf({"zklock_key_names": "hashd"})
    assert err.value.problems == ("zklock_key_names must be one of readable, hashed, not 'hashd'",)


def test_task_defaults_and_metrics_name_every_wrong_setting_at_once():
    from celery_zklock.conf import MetricsSettings, TaskDefaults

    with pytest.raises(ConfigurationError) as err:
        TaskDefaults.from_conf({"zklock_dedupe_ttl": -5, "zklock_default_park_limit": 0})
    assert [p.split(" must")[0] for p in err.value.problems] == ["zklock_dedupe_ttl", "zklock_default_park_limit"]
    with pytest.raises(ConfigurationError) as err:
        MetricsSettings.from_conf({"zklock_metrics_port": 0, "zklock_metrics_address": " "})
    assert [p.split(" must")[0] for p in err.value.problems] == ["zklock_metrics_port", "zklock_metrics_address"]


def test_a_configuration_error_keeps_its_problems_apart_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ConfigurationError("zklock_a is wrong", "zklock_b is wrong")))
    assert err.problems == ("zklock_a is wrong", "zklock_b is wrong")
    assert str(err) == "zklock_a is wrong\nzklock_b is wrong"
