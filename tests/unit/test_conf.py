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
