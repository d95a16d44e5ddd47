"""Benchmarks: each script prints its side-by-side table in one run.

Run them as modules from the repository's root, where the rig (``harness``) and the
test apps (``tests.apps``) they use are importable::

    python -m benchmarks.bench_lock --fsync --pin     # or: make bench
"""
