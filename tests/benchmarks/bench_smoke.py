"""The benchmarks' smallest runs are ``make bench``'s first step, not ``make test``'s.

Each one runs a whole benchmark section at its smallest size (servers, subprocesses, reports and
plots), 5-25 s apiece. ``make bench`` runs every one of them (``BENCH_SMOKE=1``) before the
benchmarks themselves, so a broken section fails there in seconds, and ``make test`` stays under 15
minutes. The benchmarks' own units (registration, options, plots, baselines) stay in ``make test``.
"""

from __future__ import annotations

import os

import pytest

#: Marks a smallest run of a benchmark section: run when ``BENCH_SMOKE`` is set (``make bench``).
SMALLEST_RUN = pytest.mark.skipif(
    not os.environ.get("BENCH_SMOKE"),
    reason="a smallest run of a benchmark section: make bench runs it first (BENCH_SMOKE=1), keeping make test "
           "under 15 minutes")
