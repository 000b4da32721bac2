"""command.py: ``carpool build-engine`` — a model of a repository to a cached TensorRT plan.

Reads the model (its model.toml and ONNX file), derives its optimization profiles (or
takes ``--profile`` flags) and refuses a set too large to build, then, where tensorrt
imports and a GPU answers the probe, finds the plan in the model's ``plans/`` folder or
builds it there, showing TensorRT's build phases. Exit status: 0 a plan is there, 1 the
build failed, 2 a refused request (the profiles, the precision, the model), 3 this
machine cannot build (no tensorrt, no GPU), each with one line saying why.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from carpool.commandline import add_command

__all__ = ["add_parsers"]

#: No tensorrt or no GPU: this machine cannot build.
EXIT_UNAVAILABLE = 3
_GET_TENSORRT = (
    "TensorRT is not on the package index: install it from NVIDIA on a GPU server, or use "
    "JetPack's with a venv made with --system-site-packages on a Jetson (docs/gpu.md)"
)


def _request(args: argparse.Namespace) -> Any:
    """The BuildRequest the flags describe: the model's [tensorrt] table, each flag given
    over it (raises ConfigError for a refused one)."""
    import dataclasses

    from carpool.common.errors import ConfigError
    from carpool.worker import repository
    from carpool.worker.tensorrt import profiles
    from carpool.worker.tensorrt.build import request_for

    repo = repository.load(args.repository)
    model = repo.models.get(args.model)
    if model is None:
        raise ConfigError(
            f"model repository {args.repository} has no model {args.model!r}; it has "
            f"{sorted(repo.models)}"
        )
    given = {
        "precision": args.precision,
        "profiles": tuple(args.profile) or None,
        "batches": tuple(args.batch) or None,
        "max_profiles": args.max_profiles,
        "max_ratio": args.max_ratio,
        "workspace_mib": args.workspace_mib,
    }
    settings = dataclasses.replace(
        model.config.tensorrt, **{k: v for k, v in given.items() if v is not None}
    )
    if args.profile:  # (flags' profiles replace the table's, batch ranges with them)
        settings = dataclasses.replace(settings, batches=())
    folder = Path(model.config.folder)  # (a repository's model always has one)
    request = request_for(model.config, folder, Path(args.repository), settings)
    profiles.check_limits(args.model, request.profiles, request.limits)
    return request


def _unavailable(why: str) -> int:
    print(f"carpool build-engine: cannot build here: {why}", file=sys.stderr)
    return EXIT_UNAVAILABLE


def _build_engine(args: argparse.Namespace) -> int:
    """build a model's TensorRT plan into its repository's engine cache

    Each setting defaults to the model's [tensorrt] table in its model.toml (the worker
    finds the plan by the same settings). Derives the optimization profiles from the
    model's buckets and shape rules (one per bucket; the batch 1..max_batch, or --batch
    ranges), or takes --profile flags, and
    refuses more than --max-profiles profiles or a dim wider than --max-ratio. Builds at
    --precision: fp32; fp16 (TensorRT 10: the FP16 flag; 11: only from an FP16 ONNX
    file); int8 (only from an ONNX file with Q/DQ nodes). The plan goes to
    DIR/MODEL/plans/KEY.plan with a JSON sidecar; the timing cache to DIR/.timing/.
    A plan already there for this ONNX file, TensorRT release, GPU, profile set and
    precision is kept (--force builds it again). Exit 0 done, 1 build failed, 2 refused,
    3 no tensorrt or no GPU here.
    """
    from carpool.worker.tensorrt.build import BuildError, ensure, prepare
    from carpool.worker.tensorrt.probe import describe, run_probe
    from carpool.worker.tensorrt.progress import listener_for
    from carpool.worker.tensorrt.versions import TrtVersion

    request = _request(args)
    for k, profile in enumerate(request.profiles):
        print(f"profile {k}: {profile.text()}")
    if args.dry_run:
        print(f"plans go to {request.folder / 'plans'}")
        return 0
    if importlib.util.find_spec("tensorrt") is None:
        return _unavailable(f"tensorrt is not installed ({_GET_TENSORRT})")
    found = run_probe()  # (this command says what it found, in one line: not logged)
    if found.device is None:
        return _unavailable(describe(found))
    from carpool.worker.engines.trt import TensorRTBuilder, tensorrt_version

    try:
        version = TrtVersion.parse(tensorrt_version())
    except ImportError as exc:
        return _unavailable(f"tensorrt does not import: {exc}")
    prepared = prepare(request, version, found.device)
    print(f"TensorRT {version}; {describe(found)}")
    try:
        with listener_for(sys.stdout) as listener:
            outcome = ensure(request, prepared, TensorRTBuilder, listener, force=args.force)
    except BuildError as exc:
        print(f"carpool build-engine: {exc}", file=sys.stderr)
        return 1
    for note in outcome.notes:
        print(note)
    print(f"{'built' if outcome.built else 'cached'}: {outcome.plan}")
    return 0


def add_parsers(sub: Any) -> None:
    from carpool.worker.tensorrt.precision import PRECISIONS

    p = add_command(sub, "build-engine", _build_engine)
    p.add_argument("--repository", required=True, metavar="DIR", help="the model repository")
    p.add_argument("model", help="the model's name (its folder in the repository)")
    p.add_argument(
        "--precision", choices=PRECISIONS, help="(default: the model's [tensorrt], else fp32)"
    )
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="NAME=MIN:OPT:MAX[,...]",
        help="one optimization profile, every input's shapes (e.g. x=1x3x48x160:8x3x48x320:"
        "8x3x48x320); repeat for more; replaces the profiles the model's config gives",
    )
    p.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="MIN:OPT:MAX",
        help="a batch range (repeat to split the batch into several profiles; "
        "default 1:PREFERRED:MAX_BATCH)",
    )
    p.add_argument("--workspace-mib", type=int, help="build scratch memory limit (MiB)")
    p.add_argument("--max-profiles", type=int, help="refuse more (default 8)")
    p.add_argument("--max-ratio", type=float, help="refuse a dim's max/min above (default 16)")
    p.add_argument("--force", action="store_true", help="build even when the cache has the plan")
    p.add_argument("--dry-run", action="store_true", help="show the profiles, build nothing")
