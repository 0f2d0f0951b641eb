"""The ``snapformat`` command: inspect, verify, dump and prune snapshots offline.

Exit codes: 0 success; 1 a snapshot or store is missing, unreadable or fails verification (the
message names the file and what is wrong); 2 bad usage. Every subcommand takes ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import InvalidPathError, InvalidRecordError, NotPublishedError, SnapshotError
from schemas.gym_files import AGENT_DIR, CONTINUATIONS_NAME
from schemas.manifest import FileEntry
from snapformat import layout
from snapformat.gym_dir import gym_part_summary
from snapformat.kinds import ALIASES, GYM_FILE_KIND, storage_of
from snapformat.progress import Progress
from snapformat.reader import Snapshot, enclosing_prefix, load_manifest, open_sequence, open_snapshot, resolve_kind
from snapformat.retention import DEFAULT_DRAFT_MIN_AGE_S
from snapformat.snapshot_store import SnapshotStore, stores_under
from snapformat.token_rows import iter_entries
from snapformat.verify import describe, open_all, verify_snapshot, verify_store


class UsageError(Exception):
    """Bad arguments (exit 2)."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(msgspec.to_builtins(value), indent=1) + "\n")


def _open(target: str) -> Snapshot:
    """A snapshot by its location, or the newest snapshot of a store."""
    try:
        return open_snapshot(target)
    except InvalidPathError:
        pass
    store = SnapshotStore(target)
    store.check_marker()
    snap = store.latest()
    if snap is None:
        raise NotPublishedError(f"{target}: the store has no published snapshot")
    return snap


def cmd_ls(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.store)
    try:
        store.check_marker()
    except NotPublishedError:
        stores = stores_under(args.store)
        if not stores:
            raise
        return _ls_stores(args, stores)
    rows = []
    for commit in store.list():
        manifest = load_manifest(store.store, commit)
        rows.append({
            "sequence": commit.sequence,
            "snapshot_id": commit.snapshot_id,
            "url": store.store.display(layout.snapshot_dir(commit.snapshot_id)),
            "committed_at": _time(commit.committed_at),
            "files": manifest.file_count,
            "bytes": manifest.total_bytes,
            "topology_fingerprint": manifest.topology_fingerprint,
        })
    if args.json:
        _emit_json(rows)
        return 0
    if not rows:
        print(f"{args.store}: no published snapshots")
    for r in rows:
        print(f"{r['sequence']:>6}  {r['committed_at']}  {r['files']:>4} files  {r['bytes'] / 2**20:>10.1f} MiB  {r['url']}")
    return 0


def _ls_stores(args: argparse.Namespace, stores: list[SnapshotStore]) -> int:
    """``ls`` of a folder that holds stores (``demo-store/``): each store and its newest snapshot."""
    rows = []
    for store in stores:
        commits = store.list()
        newest = commits[0] if commits else None
        rows.append({
            "store": store.url,
            "snapshots": len(commits),
            "newest_sequence": newest.sequence if newest else None,
            "newest_committed_at": _time(newest.committed_at) if newest else None,
            "newest_url": store.store.display(layout.snapshot_dir(newest.snapshot_id)) if newest else None,
        })
    if args.json:
        _emit_json(rows)
        return 0
    print(f"{args.store}: not a snapshot store; it holds {len(rows)} store(s):")
    for r in rows:
        newest = (f"newest {r['newest_sequence']} at {r['newest_committed_at']}  {r['newest_url']}"
                  if r["newest_sequence"] else "no published snapshot")
        print(f"  {r['store']}  {r['snapshots']:>4} snapshots  {newest}")
    return 0


def _summary(snap: Snapshot) -> dict[str, Any]:
    m = snap.manifest
    by_kind: dict[str, dict[str, int]] = {}
    files = snap.files()  # a listed part's files too (its part manifest read and checked)
    for f in files:
        k = by_kind.setdefault(f.kind, {"files": 0, "records": 0, "bytes": 0})
        k["files"] += 1
        k["records"] += f.records
        k["bytes"] += f.size
    return {
        "url": snap.url,
        "format_version": m.format_version,
        "required_features": m.required_features,
        "snapshot_id": m.snapshot_id,
        "sequence": m.sequence,
        "created_at": _time(m.created_at),
        "committed_at": _time(m.committed_at),
        "parent": msgspec.to_builtins(m.parent),
        "topology_fingerprint": m.topology_fingerprint,
        "gym_commit": msgspec.to_builtins(m.gym_commit),
        "timings_s": m.timings_s,
        "producer": m.producer,
        "kinds": by_kind,
        "bytes": _sharing(snap),
        "gym_parts": _gym_parts(snap, files),
        "listed_parts": msgspec.to_builtins(m.listed_parts),
        "files": msgspec.to_builtins(files),
    }


def _sharing(snap: Snapshot) -> dict[str, Any]:
    """Bytes this snapshot added and bytes it shares with its parent (SPEC §14.2).

    Each shared object counts once, however many entries name it: as shared when the parent's
    manifest names it too, else as new; the files of the snapshot's own folder count as new. When
    the parent is gone from this store (retention, or a copy without it), nothing can be called
    shared: ``parent`` says why, and every byte counts as new.
    """
    m = snap.manifest
    objects = {f.object: f.size for f in m.files if f.object is not None}
    own = sum(f.size for f in m.files if f.object is None) + sum(p.bytes for p in m.listed_parts)
    parent_objects: set[str] = set()
    if m.parent is None:
        parent = "none"
    else:
        try:
            found = open_sequence(snap.store, m.parent.sequence)
            if found.manifest.snapshot_id == m.parent.snapshot_id:
                parent = "read"
                parent_objects = {f.object for f in found.manifest.files if f.object is not None}
            else:
                parent = f"not in this store (sequence {m.parent.sequence} holds {found.manifest.snapshot_id})"
        except NotPublishedError:
            parent = "not in this store (deleted by retention, or not copied)"
        except SnapshotError as exc:
            parent = f"unreadable ({exc})"
    shared = {name: size for name, size in objects.items() if name in parent_objects}
    shared_bytes = sum(shared.values())
    return {
        "total": own + sum(objects.values()),
        "new": own + sum(objects.values()) - shared_bytes,
        "shared_with_parent": shared_bytes,
        "objects": len(objects),
        "objects_shared_with_parent": len(shared),
        "parent": parent,
    }


def _gym_parts(snap: Snapshot, files: list[FileEntry]) -> list[dict[str, Any]]:
    """Each part whose files Gym wrote itself (kind ``gym_file``), with its record counts; ``files``:
    every file of the snapshot (``snap.files()``, listed parts' included)."""
    suffix = "/" + layout.PART_MANIFEST_NAME
    prefixes = [f.path[: -len(suffix)] for f in snap.manifest.files if f.kind == "part_manifest"]
    by_part: dict[str, list[FileEntry]] = {p: [] for p in prefixes}  # one pass, not one per part
    for f in files:
        if (prefix := enclosing_prefix(f.path, by_part)) is not None:
            by_part[prefix].append(f)
    return [gym_part_summary(prefix, entries) for prefix, entries in by_part.items()
            if any(f.kind == GYM_FILE_KIND for f in entries)]


def cmd_show(args: argparse.Namespace) -> int:
    snap = _open(args.snapshot)
    s = _summary(snap)
    if args.json:
        _emit_json(s)
        return 0
    print(f"snapshot     {s['snapshot_id']} (sequence {s['sequence']}, format {s['format_version']})")
    print(f"location     {s['url']}")
    print(f"created      {s['created_at']}   committed {s['committed_at']}")
    parent = s["parent"]
    print(f"parent       {parent['snapshot_id'] + ' (sequence ' + str(parent['sequence']) + ')' if parent else '-'}")
    print(f"topology     {s['topology_fingerprint'] or '-'}")
    b = s["bytes"]
    if b["parent"] in ("read", "none"):
        sharing = (f"{_mib(b['shared_with_parent'])} shared with the parent ({b['objects_shared_with_parent']} of "
                   f"{b['objects']} objects)") if b["parent"] == "read" else "no parent"
    else:
        sharing = f"parent {b['parent']}: every byte counted as new"
    print(f"bytes        {_mib(b['total'])}: {_mib(b['new'])} new, {sharing}")
    gym = snap.manifest.gym_commit
    if gym:
        print(f"gym commit   {gym.checkpoint_id}: " + ", ".join(f"{p.component}/{p.name}" for p in gym.participants))
    if s["timings_s"]:
        print("timings      " + ", ".join(f"{k} {v:.3f}s" for k, v in s["timings_s"].items()))
    if s["gym_parts"]:
        print("gym parts:")
        for g in s["gym_parts"]:
            counts = ", ".join(f"{v} {k}" for k, v in g["records"].items()) or "no records"
            print(f"  {g['prefix']:<52} {g['component']:<9} {g['files']:>3} files {g['bytes']:>12} B  {counts}")
    print("parts:")
    for kind, k in sorted(s["kinds"].items()):
        print(f"  {kind:<20} {k['files']:>3} files {k['records']:>10} records {k['bytes'] / 2**20:>10.2f} MiB")
    print("files:")
    for f in snap.iter_files():
        comp = f" {f.compression}" if f.compression != "none" else ""
        print(f"  {f.path:<52} {f.kind:<19} {f.records:>9} rec {f.size:>12} B{comp}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        snap = open_snapshot(args.snapshot)
    except InvalidPathError:  # not a snapshot's location: a store, whose every snapshot is checked
        return _verify_store(args)
    progress = Progress(snap.manifest.total_bytes, f"verify {snap.manifest.snapshot_id}", enabled=not args.json)
    try:
        report = verify_snapshot(snap, progress.update)
    finally:
        progress.close()
    if args.json:
        _emit_json({"ok": report.ok, **msgspec.to_builtins(report)})
    elif report.ok:
        print(f"OK {report.snapshot}: {report.files_checked} files, {report.bytes_checked} bytes verified")
    else:
        for p in report.problems:
            print(f"FAIL {p.message}", file=sys.stderr)
        print(f"FAILED {report.snapshot}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 0 if report.ok else 1


def _verify_store(args: argparse.Namespace) -> int:
    """``verify`` of a store: every published snapshot, each shared object hashed once, and a bad
    object named once with every snapshot and file that references it."""
    store = SnapshotStore(args.snapshot)
    store.check_marker()
    snapshots, unreadable = open_all(store.store)
    if not snapshots and not unreadable:
        raise NotPublishedError(f"{args.snapshot}: the store has no published snapshot")
    objects = {f.object: f.size for snap in snapshots for f in snap.manifest.files if f.object is not None}
    total = sum(objects.values()) + sum(f.size for snap in snapshots for f in snap.manifest.files if f.object is None) \
        + sum(p.bytes for snap in snapshots for p in snap.manifest.listed_parts)
    progress = Progress(total, f"verify {len(snapshots)} snapshots", enabled=not args.json)
    try:
        report = verify_store(store.store, progress.update, opened=(snapshots, unreadable))
    finally:
        progress.close()
    files = sum(r.files_checked for r in report.snapshots)
    checked = sum(r.bytes_checked for r in report.snapshots)
    if args.json:
        _emit_json({"ok": report.ok, "files_checked": files, "bytes_checked": checked, **msgspec.to_builtins(report)})
    elif report.ok:
        print(f"OK {report.store}: {len(report.snapshots)} snapshots, {files} files, {checked} bytes verified "
              f"({report.objects_checked} shared objects, {report.object_bytes_checked} bytes, each hashed once)")
    else:
        bad = [p.location for p in report.object_problems]
        for p in report.problems:  # a commit record or manifest that cannot be read (the message names it)
            print(f"FAIL {p.message}", file=sys.stderr)
        for op in report.object_problems:
            print(f"FAIL {describe(op)}", file=sys.stderr)
        count = len(report.problems) + len(report.object_problems)
        for r in report.snapshots:
            for p in r.problems:
                if not any(location in p.message for location in bad):  # said once above, with every user
                    print(f"FAIL {p.message}", file=sys.stderr)
                    count += 1
        failed = sum(1 for r in report.snapshots if not r.ok)
        print(f"FAILED {report.store}: {count} problem(s); {failed} of {len(report.snapshots)} snapshots fail",
              file=sys.stderr)
    return 0 if report.ok else 1


def _rows_iter(snap: Snapshot, part: str) -> Iterator[pa.RecordBatch]:
    for entry in snap.select(part):
        yield from snap.iter_batches(entry)


def _is_rows(snap: Snapshot, part: str) -> bool:
    entries = snap.select(part)
    if not entries:
        raise NotPublishedError(f"{snap.url}: has no {part!r} part")
    kinds = {storage_of(e.kind) for e in entries}
    if "unknown" in kinds:
        raise UsageError(f"{part!r}: kind {entries[0].kind!r} is not known to this version of snapformat")
    return kinds == {"rows"}


def _is_tokens(snap: Snapshot, part: str) -> bool:
    return all(e.kind == "token_capture_rows" for e in snap.select(part))


def _resolve_part(snap: Snapshot, part: str) -> None:
    try:
        snap.select(part)
    except InvalidRecordError as exc:
        raise UsageError(str(exc)) from None


def _gym_entries(snap: Snapshot, part: str) -> list[FileEntry]:
    """Gym's own files that ``part`` names: the file itself when it is one, and for
    ``continuations`` every ``gym/agent/.../continuations.jsonl`` (Gym's continuation indexes)."""
    gym = snap.files(GYM_FILE_KIND)
    exact = [f for f in gym if f.path == part]
    if exact:
        return exact
    try:
        kind = resolve_kind(part)
    except InvalidRecordError:
        return []
    if kind != "continuations":
        return []
    return [f for f in gym if f.path.startswith(f"{layout.GYM_PREFIX}/{AGENT_DIR}/")
            and f.path.rsplit("/", 1)[-1] == CONTINUATIONS_NAME]


def _cat_gym(snap: Snapshot, entries: list[FileEntry], limit: int | None, n: int) -> int:
    """Print Gym's files as they are: each non-blank line of a JSON-lines file, a JSON document whole."""
    out = sys.stdout
    for entry in entries:
        name = entry.path.rsplit("/", 1)[-1]
        if not name.endswith((".jsonl", ".json")):
            raise UsageError(f"{entry.path}: a Gym archive, not text (its members are listed in agent-index.jsonl)")
        data = snap.read_bytes(entry)
        lines = [line for line in data.split(b"\n") if line.strip()] if name.endswith(".jsonl") else [data.rstrip(b"\n")]
        for line in lines:
            if limit is not None and n >= limit:
                return n
            out.write(line.decode("utf-8", "replace") + "\n")
            n += 1
    return n


def cmd_cat(args: argparse.Namespace) -> int:
    snap = _open(args.snapshot)
    out = sys.stdout
    limit = args.limit
    n = 0
    gym = _gym_entries(snap, args.part)
    if gym:
        if args.format != "jsonl":
            raise UsageError(f"--format {args.format} is for row parts (training, tokens); Gym's files print as they are")
        if any(f.path == args.part for f in gym):
            _cat_gym(snap, gym, limit, 0)
            return 0
        if snap.files("continuations"):  # this project's own continuation parts, then Gym's files
            for rec in snap.iter_records("continuations"):
                if limit is not None and n >= limit:
                    return 0
                out.write(msgspec.json.encode(rec).decode() + "\n")
                n += 1
        _cat_gym(snap, gym, limit, n)
        return 0
    _resolve_part(snap, args.part)
    rows = _is_rows(snap, args.part)
    if rows and args.format == "jsonl" and _is_tokens(snap, args.part):
        # Gym's own record, as its TokenEntry.model_validate_json accepts it, one per line.
        for entry in snap.select(args.part):
            for token_entry in iter_entries(snap.iter_batches(entry), snap.where(entry)):
                if limit is not None and n >= limit:
                    return 0
                out.write(json.dumps(token_entry, separators=(",", ":")) + "\n")
                n += 1
        return 0
    if rows:
        writer = None
        for batch in _rows_iter(snap, args.part):
            for row in batch.to_pylist():
                if limit is not None and n >= limit:
                    return 0
                if args.format == "csv":
                    if writer is None:
                        writer = csv.writer(out)
                        writer.writerow(batch.schema.names)
                    writer.writerow(json.dumps(v) if isinstance(v, (list, dict)) else v for v in row.values())
                else:
                    out.write(json.dumps(row) + "\n")
                n += 1
        return 0
    if args.format != "jsonl":
        raise UsageError(f"--format {args.format} is for row parts (training, tokens); record parts print as JSON lines")
    for rec in snap.iter_records(args.part):
        if limit is not None and n >= limit:
            break
        out.write(msgspec.json.encode(rec).decode() + "\n")
        n += 1
    return 0


def _records_table(records: list[Any]) -> pa.Table:
    """Records as a table; nested values (state, payloads, maps) become JSON text columns."""
    rows = []
    for rec in records:
        row = {}
        for k, v in msgspec.to_builtins(rec).items():
            row[k] = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) and k not in ("rollout_ids", "restart_only") else v
        rows.append(row)
    return pa.Table.from_pylist(rows)


def cmd_export(args: argparse.Namespace) -> int:
    snap = _open(args.snapshot)
    _resolve_part(snap, args.part)
    if not args.out.endswith(".parquet"):
        raise UsageError(f"{args.out}: the output must be a .parquet file")
    entries = snap.select(args.part)
    rows = 0
    if _is_rows(snap, args.part):
        progress = Progress(sum(e.size for e in entries), f"export {args.part}", enabled=not args.json)
        writer = None
        try:
            for entry in entries:
                for batch in snap.iter_batches(entry):
                    if writer is None:
                        writer = pq.ParquetWriter(args.out, batch.schema, compression="zstd")
                    writer.write_batch(batch)
                    rows += batch.num_rows
                    progress.update(batch.nbytes)
        finally:
            if writer is not None:
                writer.close()
            progress.close()
    else:
        table = _records_table(list(snap.iter_records(args.part)))
        pq.write_table(table, args.out, compression="zstd")
        rows = table.num_rows
    result = {"snapshot": snap.url, "part": args.part, "out": args.out, "rows": rows}
    if args.json:
        _emit_json(result)
    else:
        print(f"wrote {rows} rows of {args.part} to {args.out}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.store)
    store.check_marker()
    try:
        report = store.gc(keep_latest=args.keep, min_age_s=args.min_age, grace_s=args.grace)
    except InvalidRecordError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _emit_json(report)
        return 0
    print(f"deleted {len(report.deleted_snapshots)} snapshot(s), swept {len(report.swept_drafts)} draft(s), "
          f"{len(report.swept_temp_files)} temporary file(s) and {len(report.aborted_uploads)} incomplete upload(s); "
          f"kept sequences {report.kept}")
    k = report.kept_objects
    if report.objects_not_swept is not None:
        print(f"objects: none swept: {report.objects_not_swept}")
    else:
        print(f"objects: swept {len(report.swept_objects)} ({_mib(report.swept_object_bytes)}) that nothing references "
              f"and older than the {report.grace_s:g} s grace period; kept {k.committed + k.drafts + k.young} "
              f"({_mib(k.bytes)}): {k.committed} named by committed snapshots, {k.drafts} by drafts only, "
              f"{k.young} unreferenced but younger than the grace period")
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    from snapformat.copy import copy_snapshot, copy_store, destination_store

    try:
        single = open_snapshot(args.src)
    except InvalidPathError:
        single = None
    if single is not None:
        dst = destination_store(args.dst, single.manifest.snapshot_id)
        progress = Progress(single.manifest.total_bytes, f"copy {single.manifest.snapshot_id}", enabled=not args.json)
        try:
            results = [copy_snapshot(single, dst, progress.update)]
        finally:
            progress.close()
    else:
        results = copy_store(args.src, destination_store(args.dst, None))
    if args.json:
        _emit_json(results)
        return 0
    for r in results:
        shared = r.objects_copied + r.objects_replaced + r.objects_present + r.objects_reused
        objects = (f"  (objects: {r.objects_copied + r.objects_replaced} written, {r.objects_present + r.objects_reused} "
                   f"already there{f', {r.objects_replaced} damaged ones replaced' if r.objects_replaced else ''})"
                   if shared else "")
        print(f"{'already there' if r.skipped else 'copied':>13}  sequence {r.sequence}  {r.bytes:>12} B  {r.url}{objects}")
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from snapformat.adopt import adopt_part

    receipt = adopt_part(args.draft, args.dir, args.prefix, args.writer)
    if args.json:
        _emit_json(receipt)
        return 0
    print(f"adopted {args.dir} as part {receipt.prefix} of {args.draft} "
          f"(writer {receipt.writer}, part manifest {receipt.part_manifest_checksum})")
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    from snapformat.adopt import gym_prefixes, materialize_part

    snap = _open(args.snapshot)
    prefixes = args.prefix or gym_prefixes(snap)
    written: dict[str, list[str]] = {}
    for prefix in prefixes:  # each into <dir>/<prefix without gym/>: a checkpoint_dir Gym can read
        rel = prefix.removeprefix("gym/")
        written[prefix] = materialize_part(snap, prefix, str(Path(args.dir) / rel))
    if args.json:
        _emit_json({"snapshot": snap.url, "checkpoint_dir": str(args.dir), "parts": written})
        return 0
    for prefix, names in written.items():
        print(f"{prefix}: {len(names)} files into {Path(args.dir) / prefix.removeprefix('gym/')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snapformat", description="Inspect, verify and prune rollout snapshots.")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    sp = add("ls", "list published snapshots, newest first")
    sp.add_argument("store", help="a store: local path or URL")
    sp.set_defaults(func=cmd_ls)
    sp = add("show", "show a snapshot's manifest")
    sp.add_argument("snapshot", help="a snapshot location as ls prints it, or a store (its newest snapshot)")
    sp.set_defaults(func=cmd_show)
    sp = add("verify", "check every byte and cross-reference of a snapshot, or of every snapshot of a store")
    sp.add_argument("snapshot", help="a snapshot location as ls prints it, or a store (every snapshot; each shared "
                                     "object hashed once)")
    sp.set_defaults(func=cmd_verify)
    parts = ", ".join(sorted(ALIASES))
    sp = add("cat", "print a part as JSON lines (token rows as Gym's TokenEntry; rows also as CSV)")
    sp.add_argument("snapshot")
    sp.add_argument("part", help=f"a file path from show, or one of: {parts}")
    sp.add_argument("--format", choices=("jsonl", "columns", "csv"), default="jsonl",
                    help="jsonl: records, and token rows as Gym's TokenEntry JSON; columns: rows as their "
                         "Arrow columns, one JSON object a row; csv: rows as CSV")
    sp.add_argument("--limit", type=int, default=None, help="print at most this many records")
    sp.set_defaults(func=cmd_cat)
    sp = add("export", "write a part as Parquet (for DuckDB, Polars...)")
    sp.add_argument("snapshot")
    sp.add_argument("part")
    sp.add_argument("out", help="OUT.parquet")
    sp.set_defaults(func=cmd_export)
    sp = add("copy", "copy a snapshot or a whole store to another store (local <-> s3)")
    sp.add_argument("src", help="a snapshot location or a store")
    sp.add_argument("dst", help="a store (or the snapshot's location in it)")
    sp.set_defaults(func=cmd_copy)
    sp = add("adopt", "make a folder of Gym's plain files one part of a draft (checked, uploaded, part manifest)")
    sp.add_argument("dir", help="the participant's folder (e.g. <checkpoint_dir>/agent/instance-<sha>)")
    sp.add_argument("draft", help="the draft's location (<store>/snapshots/<snapshot_id>)")
    sp.add_argument("prefix", help="the part prefix (e.g. gym/agent/instance-<sha>)")
    sp.add_argument("--writer", default=None, help="label of the part's writer (default: the prefix)")
    sp.set_defaults(func=cmd_adopt)
    sp = add("materialize", "download a snapshot's Gym parts into a local checkpoint_dir (every byte checked)")
    sp.add_argument("snapshot", help="a snapshot location as ls prints it, or a store (its newest snapshot)")
    sp.add_argument("dir", help="the checkpoint_dir to fill (agent/instance-<sha>/, model-ledger/<name>/, ...)")
    sp.add_argument("--prefix", action="append", default=None,
                    help="only this part (repeatable; default: every Gym part of the snapshot)")
    sp.set_defaults(func=cmd_materialize)
    sp = add("gc", "apply retention, sweep drafts left by crashed writers and shared objects nothing references")
    sp.add_argument("store")
    sp.add_argument("--keep", type=int, default=None, help="keep only the newest K published snapshots")
    sp.add_argument("--min-age", type=float, default=DEFAULT_DRAFT_MIN_AGE_S,
                    help="sweep unpublished drafts idle for at least this many seconds (default 6 h)")
    sp.add_argument("--grace", type=float, default=None,
                    help="sweep shared objects nothing references once they are this many seconds old "
                         "(default and minimum: --min-age)")
    sp.set_defaults(func=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"snapformat {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        sys.stderr.close()  # the reader (e.g. `head`) went away: not an error
        return 0
    except SnapshotError as exc:
        print(f"snapformat {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
