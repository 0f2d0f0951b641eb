"""Helpers for tests and benchmarks: real S3-compatible servers on loopback."""
