"""Benchmarks: each script prints its side-by-side table in one run.

Run them as modules from the repository's root, where the rig (``harness``) they use is
importable. Their apps are their own (``*_bench_app.py``): nothing here imports ``tests/``::

    python -m benchmarks.bench_lock --fsync --pin     # or: make bench
"""
