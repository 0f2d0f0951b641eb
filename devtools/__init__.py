"""Test, benchmark and demo tooling: NOT part of the product, NOT shipped in the wheel.

``pyproject.toml`` ships ``schemas``, ``snapformat``, ``gymkit``, ``coordinator`` and ``refgym``
only; this package is used from a checkout of the repository (``tests/``, ``benchmarks/``, the
demo and soak drivers). It may import every product package; no product package may import it
(``tests/test_layering.py`` checks). See README.md beside this file for what each module holds.
"""
