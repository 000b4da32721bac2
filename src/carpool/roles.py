"""roles.py: the configuration of each role (``broker``, ``worker``) from its layers.

In this order, each over the one before: the TOML file (``--config``), the role's
``CARPOOL_<ROLE>_*`` environment variables, ``--set KEY=VALUE`` flags, then the role's
named flags (``--max-batch``, ``--frontend``, ...). Names come from the config
dataclasses (:mod:`carpool.common.settings`); the whole is checked at once, so a bad value
from any layer is reported with its key and the rule, and the variables and flags that
were given. The entry points pass ``os.environ``; nothing here reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from carpool.common.config import MAX_BATCH_CEILING, from_mapping, load_toml
from carpool.common.errors import ConfigError
from carpool.common.settings import (
    Layers,
    check_variables,
    from_environment,
    from_flags,
    variables,
)
from carpool.curvecmd import broker_curve, worker_curve

if TYPE_CHECKING:
    from carpool.broker.config import BrokerConfig
    from carpool.worker.config import ModelConfig, WorkerConfig
    from carpool.worker.server import WorkerServer

logger = logging.getLogger(__name__)


def role_classes() -> dict[str, type]:
    """Each role's config dataclass, by the role's name (its variables' ``<ROLE>``)."""
    from carpool.broker.config import BrokerConfig
    from carpool.worker.config import WorkerConfig

    return {"broker": BrokerConfig, "worker": WorkerConfig}


def known_variables() -> set[str]:
    """Every role's environment variables (a process may run either)."""
    return {name for role, cls in role_classes().items() for name in variables(role, cls)}


def check_environment(environ: Mapping[str, str]) -> list[str]:
    """Refuse the ``CARPOOL_*`` variables of ``environ`` that look meant as a setting of
    some role, or of the process, but are none (:func:`~carpool.common.settings.
    check_variables`); returns the other unknown ``CARPOOL_*`` names, to warn of.

    Raises:
        ConfigError: naming each refused variable and the setting it was probably meant as.
    """
    return check_variables(environ, known_variables(), role_classes())


def _overlay(data: dict[str, Any], pairs: Mapping[str, Any]) -> dict[str, Any]:
    """Apply non-None values of ``pairs`` over ``data``."""
    return {**data, **{k: v for k, v in pairs.items() if v is not None}}


def _checked(cls: type[Any], data: Mapping[str, Any], layers: Layers) -> Any:
    try:
        return from_mapping(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{layers.note()}") from None


def broker_config(args: argparse.Namespace, environ: Mapping[str, str]) -> BrokerConfig:
    """The BrokerConfig of ``carpool broker ARGS`` under ``environ`` (a key that changes
    nothing under its policy is logged: :func:`~carpool.broker.config.unused_settings`)."""
    from carpool.broker.config import BrokerConfig, unused_settings

    layers = Layers()
    data = load_toml(args.config) if args.config else {}
    data = from_environment(data, "broker", BrokerConfig, environ, layers)
    data = from_flags(data, BrokerConfig, args.set or (), layers)
    flags = {"frontend": args.frontend, "backend": args.backend, "local_backend": args.local}
    flags["metrics"] = getattr(args, "metrics", None)
    data = broker_curve(_overlay(data, flags), args)
    batching = {
        "max_batch": args.max_batch,
        "max_wait_s": None if args.max_wait_ms is None else args.max_wait_ms / 1000,
        "policy": args.policy,
    }
    table = data.get("batching", {})
    if isinstance(table, Mapping):  # (else from_mapping reports it)
        data = {**data, "batching": _overlay(dict(table), batching)}
    given = {**flags, **batching}
    layers.given += [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    config: BrokerConfig = _checked(BrokerConfig, data, layers)
    for key in unused_settings(config):
        logger.warning("%s has no effect: the seed policy alone reads it (docs/batching.md)", key)
    return config


def embedded_workers(args: argparse.Namespace) -> list[WorkerServer]:
    """The worker to run inside the broker's process (``--embed-*``), if any."""
    from carpool.worker.config import ModelConfig, WorkerConfig
    from carpool.worker.factory import worker_server

    config = WorkerConfig(name="embedded")
    models: list[ModelConfig] = []
    if getattr(args, "embed_config", None):
        data, _ = with_repository(load_toml(args.embed_config))
        config = from_mapping(WorkerConfig, {"name": "embedded", **data})
        if "models" in data:  # else WorkerConfig's default model is not wanted here
            models += config.models
    max_batch = getattr(args, "embed_max_batch", None) or MAX_BATCH_CEILING
    for name in getattr(args, "embed_model", None) or ():
        models.append(ModelConfig(name=name, max_batch=max_batch))
    synthetic = getattr(args, "embed_synthetic", None)
    if synthetic:
        fixed_ms, per_sample_ms = synthetic
        models.append(ModelConfig.synthetic("synthetic", fixed_ms, per_sample_ms, max_batch))
    if not models:
        return []
    config = dataclasses.replace(config, models=tuple(models))  # checks unique names
    return [worker_server(config, embedded=True)]


def worker_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> WorkerConfig:
    """The WorkerConfig of ``carpool worker ARGS`` under ``environ`` (default: none)."""
    from carpool.worker.config import ModelConfig, WorkerConfig, model_from_arg

    layers = Layers()
    data = load_toml(args.config) if args.config else {}
    data = from_environment(data, "worker", WorkerConfig, environ or {}, layers)
    data = from_flags(data, WorkerConfig, getattr(args, "set", None) or (), layers)
    flags = {"broker": args.broker, "name": args.name, "slots": args.slots}
    flags["metrics"] = getattr(args, "metrics", None)
    data = _overlay(data, {**flags, "repository": args.repository, **worker_curve(args)})
    data, repository = with_repository(data)
    config: WorkerConfig = _checked(WorkerConfig, data, layers)
    # --model and --synthetic add up, and together replace the file's [[models]] (and
    # the repository's models: --model NAME picks one of them).
    models = [model_from_arg(m, repository) for m in args.model or ()]
    if args.synthetic:
        fixed_ms, per_sample_ms = args.synthetic
        name = args.synthetic_name or "synthetic"
        models.append(ModelConfig.synthetic(name, fixed_ms, per_sample_ms, MAX_BATCH_CEILING))
    elif args.synthetic_name is not None:
        raise ConfigError("--synthetic-name names the model of --synthetic, which is not given")
    if models:
        config = dataclasses.replace(config, models=tuple(models))
    # --max-batch and --threads apply to every model served, the file's ones included.
    limits: dict[str, Any] = {}
    if args.max_batch is not None:
        limits["max_batch"] = args.max_batch
    if args.threads is not None:
        limits["intra_op_threads"] = args.threads
    if limits:
        config = dataclasses.replace(
            config, models=tuple(_limited(m, limits) for m in config.models)
        )
    return config


def with_repository(
    data: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, ModelConfig] | None]:
    """worker.toml's ``data`` with its models taken from its ``repository`` (if any:
    ``repository.worker_models``), and that repository's models by name."""
    folder = data.get("repository")
    if not folder or not isinstance(folder, str):
        return data, None  # (a repository of the wrong type: from_mapping reports it)
    from carpool.worker.repository import load, worker_models

    repository = load(folder)
    return worker_models(data, repository), repository.configs()


def _limited(model: ModelConfig, limits: dict[str, Any]) -> ModelConfig:
    """``model`` with the flags' limits; preferred batch sizes above a --max-batch are
    dropped (they are advice to the broker; the flag is the operator's word)."""
    if "max_batch" in limits:
        cap = limits["max_batch"]
        limits = {**limits, "preferred_batch": tuple(p for p in model.preferred_batch if p <= cap)}
    return dataclasses.replace(model, **limits)
