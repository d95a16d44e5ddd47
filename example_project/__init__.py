"""An example Celery project that uses every feature of celery-zklock.

Run from the repository's root: ``python -m example_project.demo`` (or ``make demo``)
starts the servers, workers and beats and shows every promise kept; by hand,
``celery -A example_project.app worker`` and ``celery -A example_project.app beat``.
"""
