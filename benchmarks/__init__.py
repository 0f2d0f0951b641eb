"""Benchmarks of snapformat: ``make bench`` runs ``python -m benchmarks.run`` (see ``run.py``)."""
