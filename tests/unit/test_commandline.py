"""carpool.commandline: a command's help comes from the docstring of the function that runs it."""

from __future__ import annotations

import argparse

from carpool.broker.config import BatchingConfig
from carpool.commandline import add_batching_flags, add_command
from carpool.common.jsonlines import parses


def _run(args: argparse.Namespace) -> int:
    """do a thing

    At length: what the thing
    does, in two lines.

    And a second paragraph.
    """
    return 0


def _terse(args: argparse.Namespace) -> int:
    """do another thing"""
    return 0


def test_help_and_description_come_from_the_docstring() -> None:
    parser = argparse.ArgumentParser(prog="carpool")
    sub = parser.add_subparsers(dest="command", required=True)
    run = add_command(sub, "run", _run, epilog="the end")
    terse = add_command(sub, "terse", _terse)
    assert (
        run.description == "At length: what the thing does, in two lines. And a second paragraph."
    )
    assert run.epilog == "the end"
    assert terse.description is None
    assert "do a thing" in parser.format_help()
    assert "do another thing" in parser.format_help()
    args = parser.parse_args(["run"])
    assert args.func is _run


def test_batching_flags_have_no_defaults_unless_given_some() -> None:
    live = argparse.ArgumentParser()
    add_batching_flags(live)
    assert vars(live.parse_args([])) == {"max_batch": None, "max_wait_ms": None, "policy": None}
    simulated = argparse.ArgumentParser()
    add_batching_flags(simulated, BatchingConfig(max_batch=3, max_wait_s=0.002, policy="fixed"))
    args = simulated.parse_args([])
    assert (args.max_batch, args.max_wait_ms, args.policy) == (3, 2.0, "fixed")
    assert "(default 2)" in simulated.format_help()


def test_a_trace_line_parses_as_text_or_bytes() -> None:
    assert parses('{"t_s": 0}')
    assert parses(b'{"t_s": 0}')
    assert not parses('{"t_s": 0')
    assert not parses(b"\xff")
