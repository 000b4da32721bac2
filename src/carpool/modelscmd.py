"""modelscmd.py: ``carpool models check [DIR]``, ``list [DIR]`` and ``show [NAME]``.

``check`` and ``list`` read a model repository (docs/models.md), the built-in one
without ``DIR``; the work is in :mod:`carpool.worker.modelcheck`. ``show`` asks a running
broker what its live workers serve (METADATA, docs/protocol.md §6.6).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from carpool.commandline import add_command
from carpool.ops.status import add_client_flags

if TYPE_CHECKING:
    from carpool.common.protocol import ModelMetadata

__all__ = ["add_parsers"]


def _root(args: argparse.Namespace) -> str:
    from carpool.worker.repository import BUILTIN_ROOT

    return str(args.dir or BUILTIN_ROOT)


def _check(args: argparse.Namespace) -> int:
    """validate a model repository

    Reads every DIR/<name>/model.toml, finds each model's ONNX file (a [source] wheel at
    its pinned version and sha256), reads its inputs and outputs, and checks the shape
    rules, pad rules, crops and warm-up shapes against them. Prints each problem as
    FILE: KEY: rule and exits 1 if there is any. Without DIR: the built-in models.
    """
    from carpool.worker.modelcheck import check

    root = _root(args)
    repository, problems = check(root)
    for problem in problems:
        print(problem)
    count = len(repository.models)
    if problems:
        print(f"{root}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{root}: {count} model(s), no problems")
    return 0


def _list(args: argparse.Namespace) -> int:
    """show the models of a model repository

    Each model's name, description, backends, max batch, file, and its inputs and
    outputs as its ONNX file has them (B: the batch dim, ?: a dynamic dim), with their
    shape rules, buckets and crops. Without DIR: the built-in models.
    """
    from carpool.worker.modelcheck import describe
    from carpool.worker.repository import scan

    root = _root(args)
    repository, problems = scan(root)
    for model in repository.models.values():
        lines, found = describe(model)
        print("\n".join(lines))
        problems += found
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _show(args: argparse.Namespace) -> int:
    """show the models a running broker serves

    Asks the broker at --endpoint (METADATA) what its live workers serve: each model's
    inputs and outputs (B: the batch dim, ?: a dynamic dim) with their shape rules,
    buckets and crops, its batch limits, and the workers that serve it, by name. NAME:
    that model only. Exits 1 when no live worker serves NAME, 2 when no broker answers
    within --timeout.
    """
    from carpool.client import NotFound
    from carpool.common.errors import ConfigError
    from carpool.ops.status import open_client

    try:
        client = open_client(args)
    except ConfigError as exc:
        print(f"carpool models show: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.name:
                found: tuple[ModelMetadata, ...] = (client.model(args.name, args.timeout),)
            else:
                found = client.models(args.timeout)
        except NotFound as exc:
            print(f"carpool models show: {exc}", file=sys.stderr)
            return 1
        except TimeoutError:
            print(f"carpool models show: no broker answered at {args.endpoint}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps([m.to_wire() for m in found], indent=2))
    else:
        print("\n".join(line for m in found for line in _served(m)))
    return 0


def _served(model: ModelMetadata) -> list[str]:
    """One model as ``carpool models show`` prints it (as ``list`` does, from the wire)."""
    from carpool.worker.modelcheck import io_lines

    spec = model.spec
    preferred = f" (preferred {list(spec.preferred_batch)})" if spec.preferred_batch else ""
    count = len(spec.inputs)
    inputs = zip(
        spec.inputs, spec.rules or (None,) * count, spec.pads or (None,) * count, strict=True
    )
    outputs = zip(spec.outputs, spec.crops or ((),) * len(spec.outputs), strict=True)
    return [
        spec.name,
        f"  workers    {', '.join(model.workers)}",
        f"  max_batch  {spec.max_batch}{preferred}",
        *io_lines(inputs, outputs),
    ]


def _models(args: argparse.Namespace) -> int:
    """inspect a model repository (check, list) or a running broker's models (show)"""
    return 2  # (argparse requires a sub-command)


def add_parsers(sub: Any) -> None:
    m = add_command(sub, "models", _models)
    commands = m.add_subparsers(dest="models_command", required=True)
    for name, func in (("check", _check), ("list", _list)):
        p = add_command(commands, name, func)
        p.add_argument("dir", nargs="?", help="the repository (default: the built-in models)")
    show = add_command(commands, "show", _show)
    show.add_argument("name", nargs="?", help="the model (default: every model served)")
    show.add_argument("--json", action="store_true", help="print the METADATA maps as JSON")
    add_client_flags(show)
