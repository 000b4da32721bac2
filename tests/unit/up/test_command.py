"""``carpool up``'s flags as the broker and workers it starts get them."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from carpool.cli import build_parser
from carpool.common.curve import create_keypair, load_keypair
from carpool.up.command import _metrics_roles, child_args


def _args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_the_broker_and_worker_flags_go_to_their_commands() -> None:
    broker, worker = child_args(
        _args(
            *("--max-batch", "16", "--max-wait-ms", "4", "--policy", "fixed"),
            *("--broker-config", "b.toml", "--worker-config", "w.toml"),
            *("--model", "orientation", "--model", "my=/m/my.onnx", "--synthetic", "5", "0.5"),
            *("--worker-max-batch", "32", "--threads", "2", "--slots", "3"),
        )
    )
    assert broker == [
        *("--config", "b.toml", "--max-batch", "16", "--max-wait-ms", "4.0"),
        *("--policy", "fixed"),
    ]
    assert worker == [
        *("--config", "w.toml", "--max-batch", "32", "--threads", "2", "--slots", "3"),
        *("--model", "orientation", "--model", "my=/m/my.onnx", "--synthetic", "5", "0.5"),
    ]


def test_no_flags_pass_nothing_on() -> None:
    assert child_args(_args()) == ([], [])


def test_the_curve_keys_go_to_the_broker_and_the_workers(tmp_path: Path) -> None:
    _, secret = create_keypair(tmp_path / "broker", "broker")
    _, worker_secret = create_keypair(tmp_path / "workers", "w")
    broker, worker = child_args(
        _args(
            *("--curve", "--curve-server-key", str(secret)),
            *("--curve-workers", str(tmp_path / "workers")),
            *("--curve-worker-key", str(worker_secret)),
        )
    )
    assert broker == [
        *("--curve-server-key", str(secret), "--curve-workers", str(tmp_path / "workers")),
        "--curve",
    ]
    public = load_keypair(secret).public.decode()
    assert worker == ["--curve-key", str(worker_secret), f"--curve-broker-key={public}"]
    assert "key_secret" not in " ".join(worker[2:])  # the broker's secret stays in its file


def test_a_broker_key_beginning_with_a_dash_reaches_the_worker_whole(tmp_path: Path) -> None:
    for n in range(5000):  # (about 1 key in 85 begins with "-")
        _, secret = create_keypair(tmp_path / f"broker-{n}", "broker")
        public = load_keypair(secret).public.decode()
        if public.startswith("-"):
            break
    else:
        pytest.fail("no key beginning with '-' in 5,000")
    _, worker_secret = create_keypair(tmp_path / "workers", "w")
    _, worker = child_args(
        _args("--curve-server-key", str(secret), "--curve-worker-key", str(worker_secret))
    )
    parsed = build_parser().parse_args(["worker", *worker])
    assert parsed.curve_broker_key == public


@pytest.mark.parametrize("role", ["broker", "worker"])
def test_the_metrics_flag_is_passed_exactly_where_the_command_takes_it(role: str) -> None:
    takes = re.search(r"--metrics\b(?!-)", _help(role)) is not None
    assert (role in _metrics_roles()) is takes


def _help(role: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    return out.getvalue()
