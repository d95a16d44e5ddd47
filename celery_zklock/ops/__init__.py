"""For operators: the ``celery zklock`` commands, the tree readers they share, evict and the exporter.

Read by a different audience than the task glue, and built on it only where a command needs an
app's settings (``cli``); ``tree``, ``evict`` and ``exporter`` know ZooKeeper and the recipes alone.
"""
