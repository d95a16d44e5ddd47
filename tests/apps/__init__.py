"""The apps the tests run in real ``celery worker`` and ``celery beat`` processes
(``-A tests.apps.worker_app``), and the helper processes some tests start
(``python -m tests.apps.stress_contender``)."""
