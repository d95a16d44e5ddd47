"""How the session tames kazoo's logging during an outage: pure logic, a fake clock."""


def test_kazoo_reconnect_noise_is_one_line_per_state_change_and_a_summary_per_minute(caplog, monkeypatch):
    import logging

    from celery_zklock.zk import kazoo_logs as session

    now = [1000.0]
    monkeypatch.setattr(session.time, "monotonic", lambda: now[0])
    quiet = session._QuietReconnects()

    def log(msg, *args, level=logging.WARNING):
        return quiet.filter(logging.makeLogRecord({"msg": msg, "args": args, "levelno": level}))

    caplog.set_level(logging.DEBUG, logger="celery_zklock")
    assert log("Connection dropped: %s", "socket closed")  # the first failure is news
    assert not log("Transition to CONNECTING")
    for _ in range(40):  # one attempt a second
        now[0] += 1
        assert not log("Connection time-out: %s", "connect timed out")
    assert "still unreachable" not in caplog.text
    now[0] += 20
    assert not log("Connection time-out: %s", "connect timed out")  # 61 s after the first
    assert "ZooKeeper still unreachable: 42 more failed connection attempts in the last 60s" in caplog.text
    assert caplog.text.count("kazoo: Connection time-out: connect timed out") == 41  # each one at DEBUG
    assert log("Zookeeper connection established, state: %s", "CONNECTED")
    assert log("Connection dropped: %s", "again")  # a new outage is news again
    assert log("Some other kazoo warning")  # anything else passes untouched


def test_starts_given_up_during_an_outage_add_no_lines_and_a_first_reach_is_not_again(caplog, monkeypatch):
    import logging

    from celery_zklock.zk import kazoo_logs as session

    quiet = session._QuietReconnects()

    def log(msg, *args, level=logging.WARNING):
        return quiet.filter(logging.makeLogRecord({"msg": msg, "args": args, "levelno": level}))

    caplog.set_level(logging.DEBUG, logger="celery_zklock")
    assert log("Connecting to %s(%s):%s, use_ssl: %r", "h", "127.0.0.1", 1, False, level=logging.INFO)
    for _ in range(3):  # three starts given up, each: attempts, then kazoo's close
        for _ in range(2):
            assert not log("Connection dropped: %s", "refused")
            assert not log("Connecting to %s(%s):%s, use_ssl: %r", "h", "127.0.0.1", 1, False, level=logging.INFO)
        assert not log("Closing connection to %s:%s", "127.0.0.1", 1, level=logging.INFO)
        assert not log("Zookeeper session closed, state: %s", "CLOSED", level=logging.INFO)
    assert "reachable" not in caplog.text and "before the session closed" not in caplog.text
    assert log("Zookeeper connection established, state: %s", "CONNECTED", level=logging.INFO)
    # Never reached before: not "again".
    assert "ZooKeeper reachable after 18 more failed connection attempts" in caplog.text
    assert log("Connection dropped: %s", "an outage")
    assert not log("Connection dropped: %s", "an outage")
    assert log("Zookeeper connection established, state: %s", "CONNECTED", level=logging.INFO)
    assert "ZooKeeper reachable again after 1 more failed connection attempts" in caplog.text


def test_a_session_a_server_said_expired_is_reachable_again(caplog):
    import logging

    from celery_zklock.zk import kazoo_logs as session

    quiet = session._QuietReconnects()

    def log(msg, *args, level=logging.WARNING):
        return quiet.filter(logging.makeLogRecord({"msg": msg, "args": args, "levelno": level}))

    caplog.set_level(logging.DEBUG, logger="celery_zklock")
    assert log("Connection dropped: %s", "timed out")
    assert not log("Connection time-out: %s", "timed out")
    assert log("Zookeeper session closed, state: %s", "EXPIRED_SESSION")  # the server answered: it is back
    assert "ZooKeeper reachable again after 1 more failed connection attempts" in caplog.text
