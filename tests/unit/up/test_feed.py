"""The fleet page's figures from STATS answers and the supervisor's table."""

from __future__ import annotations

from carpool.up.feed import FleetFeed
from carpool.up.processes import ChildStatus, FleetStatus


def _stats(sizes: dict[str, int], workers: list[str], queued: int = 0) -> dict:
    return {
        "batch_sizes": {"m": sizes},
        "queued": queued,
        "inflight_batches": 1,
        "errors": {},
        "shed": 0,
        "workers": [
            {
                "name": name,
                "rho": 0.25,
                "slots": 2,
                "outstanding": 1,
                "health": "healthy",
                "models": ["m"],
                "lanes": {"m": {"b_max": 8}},
            }
            for name in workers
        ],
    }


FLEET = FleetStatus(
    2,
    (
        ChildStatus("broker", "running", 10, 0, None),
        ChildStatus("worker-0", "running", 11, 0, None),
        ChildStatus("worker-1", "backoff", None, 2, -9),
    ),
    stopping=False,
)


def test_qps_and_batch_sizes_are_over_the_window() -> None:
    feed = FleetFeed(window_s=10.0)
    feed.on_stats(0.0, _stats({"1": 5, "4": 1}, ["worker-0"]))
    feed.on_stats(2.0, _stats({"1": 9, "4": 3, "8": 1}, ["worker-0"], queued=7))
    view = feed.view(FLEET, [10.0] * 19 + [50.0], max_workers=4)
    # 4 batches of 1, 2 of 4, 1 of 8 in 2 s: 20 samples, 10 per second.
    assert view["batch_sizes"] == {"1": 4, "4": 2, "8": 1}
    assert view["qps"] == 10.0
    assert view["mean_batch"] == round(20 / 7, 2)
    assert view["broker"]["queued"] == 7
    assert view["latency_ms"]["p50"] == 10.0
    assert 10.0 < view["latency_ms"]["p95"] <= 50.0
    assert view["max_workers"] == 4


def test_old_answers_leave_the_window() -> None:
    feed = FleetFeed(window_s=5.0)
    for t in range(10):
        feed.on_stats(float(t), _stats({"2": t}, []))
    assert feed.answers[0][0] >= 9.0 - 5.0 - 1.0
    assert feed.view(FLEET)["qps"] == 2.0


def test_workers_are_merged_by_name_with_the_supervisors_table() -> None:
    feed = FleetFeed()
    feed.on_stats(0.0, _stats({}, ["worker-0", "elsewhere"]))
    workers = {w["name"]: w for w in feed.view(FLEET)["workers"]}
    assert workers["worker-0"]["registered"]
    assert workers["worker-0"]["pid"] == 11
    assert workers["worker-0"]["b_max"] == {"m": 8}
    assert workers["elsewhere"]["state"] == "outside"  # registered, not started by us
    assert not workers["worker-1"]["registered"]  # ours, waiting to start again
    assert workers["worker-1"]["restarts"] == 2
    assert feed.view(FLEET)["live_workers"] == 2


def test_no_answer_says_the_broker_is_down_and_no_traffic_no_latency() -> None:
    feed = FleetFeed()
    feed.on_stats(0.0, None)
    view = feed.view(FLEET)
    assert not view["broker"]["up"]
    assert view["latency_ms"] == {"p50": None, "p95": None, "p99": None}
    assert view["qps"] == 0.0
    assert view["mean_batch"] is None
