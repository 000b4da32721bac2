"""``carpool up``'s flags as the broker and workers it starts get them."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from carpool.cli import build_parser
from carpool.commandline import METRICS_COMMANDS
from carpool.common.curve import create_keypair, load_keypair
from carpool.up.command import child_args
from carpool.up.plan import FleetPlan


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


def _commands() -> list[str]:
    """Every command of ``carpool``, as its usage line lists them: ``{broker,record,...}``."""
    return re.findall(r"\{([a-z][\w,-]*)\}", build_parser().format_usage())[-1].split(",")


@pytest.mark.parametrize("command", _commands())
def test_metrics_commands_lists_exactly_the_commands_that_take_metrics(command: str) -> None:
    takes = re.search(r"--metrics\b(?!-)", _help(command)) is not None
    assert (command in METRICS_COMMANDS) is takes


def test_the_commands_of_the_table_exist_and_take_the_broker_and_the_workers() -> None:
    assert set(_commands()) >= METRICS_COMMANDS
    assert {"broker", "worker"} <= METRICS_COMMANDS  # what carpool up --metrics-base starts


@pytest.mark.parametrize("child", ["broker", "worker-0"])
def test_metrics_base_gives_each_child_a_metrics_flag_its_command_parses(child: str) -> None:
    plan = FleetPlan("tcp://f", "tcp://b", metrics_base=9100, metrics_flag=METRICS_COMMANDS)
    argv = plan.argv(child)
    assert argv[1:3] == ["-m", "carpool"]
    port = 9100 if child == "broker" else 9101
    assert build_parser().parse_args(argv[3:]).metrics == f"127.0.0.1:{port}"


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()
