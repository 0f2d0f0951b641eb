"""Decoders of Gym's records built by many threads at once do not crash the process.

msgspec 0.22.0 fills a Struct type's decoding tables the first time a decoder of it is built; a
second thread that builds or uses one meanwhile can see them half filled and dies by SIGSEGV in
``json_decode_struct_map_inner``. Gym servers hosting several participants hit it when their
restores ran on threads at once. ``snapformat.jsonl.decoder`` builds every decoder under one lock.
Checked in fresh processes (the tables are built once per process): without the lock about half of
them crashed (16 of 30)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.gym_files import ResourceSnapshot
from snapformat.jsonl import decoder

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("decoder_threads_child.py")
PROCESSES = 30


@pytest.mark.timeout(300)
def test_threads_decoding_records_for_the_first_time_at_once_do_not_crash() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    codes = [subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, timeout=60,
                            check=False).returncode for _ in range(PROCESSES)]
    assert codes == [0] * PROCESSES, f"return codes (negative: killed by that signal): {codes}"


def test_one_decoder_per_type() -> None:
    assert decoder(ResourceSnapshot) is decoder(ResourceSnapshot)
