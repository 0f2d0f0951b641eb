"""Independent checks of a finished run: every rollout trained exactly once, and the same content
as an uninterrupted run with the same seeds.

A restored rollout keeps its content but not its run number: turns after the restore were made by
run n + 1 (another capture key), so the comparison leaves out exactly the columns that name the run
(``attempt_index``, ``capture_key``, the row tags) and compares everything else, row by row, keyed
by the data plane's key.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

from coordinator.dataplane import DATAPLANE, TOKEN_CAPTURE, TRAINING

_RUN_COLUMNS = {"attempt_index", "capture_key", "row_tags"}


def content(tables: dict[str, pa.Table]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{row kind: {key: {column: value}}}`` without the columns that name a run."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in (TRAINING, TOKEN_CAPTURE, DATAPLANE):
        table = tables.get(kind)
        rows: dict[str, dict[str, Any]] = {}
        if table is not None:
            keep = [c for c in table.column_names if c not in _RUN_COLUMNS]
            for row in table.select(keep).to_pylist():
                rows[f'{row["partition_id"]}/{row["key"]}'] = row  # keys are unique within a partition
        out[kind] = rows
    return out


def differences(a: dict[str, dict[str, dict[str, Any]]], b: dict[str, dict[str, dict[str, Any]]],
                limit: int = 10) -> list[str]:
    """Human-readable differences between two runs' final rows, as :func:`content` gives them
    (empty when they are equal)."""
    out: list[str] = []
    for kind in (TRAINING, TOKEN_CAPTURE, DATAPLANE):
        missing = sorted(set(a[kind]) - set(b[kind]))
        extra = sorted(set(b[kind]) - set(a[kind]))
        if missing:
            out.append(f"{kind}: {len(missing)} rows missing, e.g. {missing[:3]}")
        if extra:
            out.append(f"{kind}: {len(extra)} rows not in the uninterrupted run, e.g. {extra[:3]}")
        for key in sorted(set(a[kind]) & set(b[kind])):
            if a[kind][key] != b[kind][key]:
                cols = [c for c in a[kind][key] if a[kind][key][c] != b[kind][key].get(c)]
                out.append(f"{kind}: row {key!r} differs in {cols}")
                if len(out) >= limit:
                    return out
    return out


def trained_once(records: dict[str, Any], rollout_ids: list[str]) -> list[str]:
    """Problems with the final bookkeeping: a rollout not trained, trained twice, a group not applied."""
    problems = []
    replay = Counter(e["rollout_id"] for e in records["replay"] if e["status"] == "applied_uncheckpointed")
    for rid in rollout_ids:
        if replay[rid] != 1:
            problems.append(f"rollout {rid} trained {replay[rid]} times (expected once)")
    groups = [r for r in records["ledger"] if r["record"] == "prompt_group"]
    problems += [f"group {g['group_id']} ended {g['state']}" for g in groups if g["state"] != "applied_uncheckpointed"]
    owed = [r["rollout_id"] for r in records["ledger"] if r["record"] == "ack_owed"]
    if owed:
        problems.append(f"acknowledgements still owed: {owed[:5]}")
    return problems
