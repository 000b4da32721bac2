"""modelscmd.py: ``carpool models check [DIR]`` and ``carpool models list [DIR]``.

Both read a model repository (docs/models.md), the built-in one without ``DIR``; the
work is in :mod:`carpool.worker.modelcheck`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from carpool.commandline import add_command

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


def _models(args: argparse.Namespace) -> int:
    """inspect a model repository (check, list)"""
    return 2  # (argparse requires a sub-command)


def add_parsers(sub: Any) -> None:
    m = add_command(sub, "models", _models)
    commands = m.add_subparsers(dest="models_command", required=True)
    for name, func in (("check", _check), ("list", _list)):
        p = add_command(commands, name, func)
        p.add_argument("dir", nargs="?", help="the repository (default: the built-in models)")
