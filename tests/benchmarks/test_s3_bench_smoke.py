"""A tiny run of the object-store benchmark (0.02 GiB of rows, one repeat, stores of 1/10/100
snapshots): every row is measured with positive numbers, the transfers moved identical bytes, the
request counts are sane and ``latest()`` sends as many requests whatever the store's size. No
timing assertions."""

from __future__ import annotations

from bench_smoke import SMALLEST_RUN

from benchmarks import s3_bench


@SMALLEST_RUN
def test_s3_bench_tiny_run() -> None:
    res = s3_bench.run(size_gib=0.02, quick=True, log=lambda _msg: None)

    assert res["rows"] > 0 and res["arrow_file_bytes"] >= 0.02 * (1 << 30) * 0.9
    got = [(m["phase"], m["method"]) for m in res["measured"]]
    assert got == [(s3_bench.UPLOAD, s3_bench.LIB_UPLOAD), (s3_bench.UPLOAD, s3_bench.S3FS_PIPE),
                   (s3_bench.DOWNLOAD, s3_bench.LIB_DOWNLOAD), (s3_bench.DOWNLOAD, s3_bench.S3FS_CAT),
                   (s3_bench.DOWNLOAD, s3_bench.S3FS_CAT_ONE)]
    for m in res["measured"]:
        assert m["times_s"] and all(t > 0 for t in m["times_s"]), m
        assert m["object_bytes"] == res["arrow_file_bytes"], m
        assert m["median_s"] > 0 and m["gb_per_s"] > 0 and m["library_speed_vs_this"] > 0, m
        assert m["request_count"] > 0, m
    assert all(r > 0 for r in res["ratios"].values())
    checks = res["checks"]
    assert checks["library_bytes_identical"] and checks["s3fs_bytes_identical"]
    assert checks["library_rows_read"] == res["rows"]

    req = res["requests"]
    assert [(r["parts"], r["rows_per_part"] // req[0]["rows_per_part"]) for r in req] == [(1, 1), (1, 10), (4, 1), (4, 10)]
    for r in req:
        assert r["requests"] > 0 and r["begin"] > 0 and r["write"] > 0 and r["publish"] > 0, r
        assert r["requests"] == r["begin"] + r["write"] + r["publish"] == sum(r["by_operation"].values()), r
        assert r["files"] == 2 * r["parts"] and r["total_bytes"] > 0, r
    one, four = req[0]["without_upload_parts"], req[2]["without_upload_parts"]
    assert four > one  # more parts (files): more requests
    assert req[1]["without_upload_parts"] - one <= 2 and req[3]["without_upload_parts"] - four <= 2 * 4  # 10x rows: at most a multipart create + complete per file

    disc = res["discovery"]
    assert [d["snapshots"] for d in disc] == [1, 10, 100]
    for d in disc:
        assert d["times_s"] and all(t > 0 for t in d["times_s"]) and d["median_s"] > 0, d
        assert d["requests"] > 0 and d["requests_min"] == d["requests_max"] == d["requests"], d
        assert d["listing_s"] > 0 and d["listing_requests"] > 0, d
    assert len({d["requests"] for d in disc}) == 1, disc  # flat: independent of the number of snapshots
    assert len({tuple(sorted(d["by_operation"].items())) for d in disc}) == 1, disc

    assert len(res["tuning"]) == len(s3_bench.TUNING) and sum(t["default"] for t in res["tuning"]) == 1
    for t in res["tuning"]:
        assert t["times_s"] and all(x > 0 for x in t["times_s"]) and t["gb_per_s"] > 0 and t["speed_vs_default"] > 0, t

    md = s3_bench.markdown(res)
    assert md.startswith("# Object-store benchmark")
    assert "| upload | snapformat" in md and "| download | s3fs: cat_file" in md
    assert md.count("\n| 1 |") >= 1 and "| 100 |" in md and res["summary"][0] in md
