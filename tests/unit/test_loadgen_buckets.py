"""`carpool bench` reports each padded model's buckets over the run (STATS ``buckets``
before and after it, protocol §6.4): batches, samples and the padded share of compute."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.benchcmd import print_report
from carpool.loadgen import bucket_counts, bucket_report, summarize


def stats(batches: int, samples: int, padded: int, elements: int) -> dict[str, Any]:
    counts = {
        "batches": batches,
        "samples": samples,
        "padded_elements": padded,
        "bucket_elements": elements,
        "padded_share": padded / elements if elements else 0.0,
    }
    return {"buckets": {"det": {"3x736x1280": counts}}}


def test_the_run_report_counts_what_the_run_added_to_each_bucket(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = bucket_counts(stats(2, 2, 100, 1000))
    after = bucket_counts(stats(5, 8, 400, 5000))
    run = bucket_report(before, after)
    assert run == {"det": {"3x736x1280": {"batches": 3, "samples": 6, "padded_share": 0.075}}}
    # A bucket the run did not use is left out, as is a STATS without buckets.
    assert bucket_report(after, after) == {}
    assert bucket_report({}, bucket_counts({})) == {}
    report = summarize([], 0.0, 1.0, {})
    report.buckets = run
    print_report(report)
    out = capsys.readouterr().out
    assert "bucket (det 3x736x1280): 3 batches, 6 samples, padded share of compute 7.5%" in out
    assert report.to_json()["buckets"] == run
