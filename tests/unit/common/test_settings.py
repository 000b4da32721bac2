"""Every setting of each role from the environment and from --set, over its file, with
names generated from the config dataclasses; unknown CARPOOL_* variables that look meant
as a setting refused, the others left to the user."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from carpool import cli, roles
from carpool.broker.config import BrokerConfig
from carpool.common.errors import ConfigError
from carpool.common.settings import (
    ALIASES,
    PROCESS_VARIABLES,
    check_variables,
    setting_paths,
    variable,
    variables,
)
from carpool.worker.config import WorkerConfig

ROLES = roles.role_classes()


def _toml(value: Any) -> str:
    """A default value as the text of its variable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value) + "]"
    if isinstance(value, dict) and not value:
        return "{}"
    raise AssertionError(f"no text for {value!r}")


def _default(cls: type, path: tuple[str, ...]) -> Any:
    obj: Any = cls()
    for key in path:
        obj = getattr(obj, key)
    return obj


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_setting_has_a_variable_that_sets_it(role: str) -> None:
    """Walks every field of the role's dataclass, sections included: its variable, given
    its default as text, gives the default config back; a different value changes it."""
    cls = ROLES[role]
    names = variables(role, cls)
    paths = setting_paths(cls)
    assert set(paths) <= set(names.values())
    for path in paths:
        name = variable(role, path)
        assert names[name] == path
        value = _default(cls, path)
        if value is None:
            continue  # (unset is its default: no text means None)
        worker_models = role == "worker" and path == ("models",)  # a list of tables
        text = '[{name = "orientation"}]' if worker_models else _toml(value)
        built = _build(role, {name: text})
        assert built == cls(), name


def _build(role: str, environ: dict[str, str], *flags: str) -> Any:
    args = cli.build_parser().parse_args([role, *flags])
    if role == "broker":
        return roles.broker_config(args, environ)
    return roles.worker_config(args, environ)


def test_variable_names_are_unique_across_roles_and_process_settings() -> None:
    every = [n for role, cls in ROLES.items() for n in variables(role, cls)]
    assert len(every) == len(set(every))
    assert not set(every) & set(PROCESS_VARIABLES)
    assert {name for _, name in ALIASES} <= set(every)


def test_a_variable_sets_a_sections_key_and_a_list() -> None:
    config = _build(
        "broker",
        {"CARPOOL_BROKER_BATCHING_MAX_BATCH": "16", "CARPOOL_BROKER_CURVE_ENABLED": "false"},
    )
    assert config.batching.max_batch == 16
    worker = _build(
        "worker",
        {
            "CARPOOL_WORKER_MODELS": '[{name = "a", engine = "synthetic", max_batch = 4}]',
            "CARPOOL_WORKER_SHM_OUTPUT_MODE": "0o640",
        },
    )
    assert [(m.name, m.max_batch) for m in worker.models] == [("a", 4)]
    assert worker.shm_output_mode == 0o640


def test_file_then_environment_then_set_then_flags(tmp_path: Path) -> None:
    toml = tmp_path / "b.toml"
    toml.write_text("max_queued = 5\nmax_workers = 6\nliveness = 7\n[batching]\nmax_batch = 2\n")
    env = {"CARPOOL_BROKER_MAX_WORKERS": "60", "CARPOOL_BROKER_LIVENESS": "70"}
    env["CARPOOL_BROKER_BATCHING_MAX_BATCH"] = "20"
    config = _build(
        "broker", env, "--config", str(toml), "--set", "liveness=71",
        "--set", "batching.max_batch=21", "--max-batch", "22",
    )  # fmt: skip
    assert (config.max_queued, config.max_workers, config.liveness) == (5, 60, 71)
    assert config.batching.max_batch == 22


def test_the_older_names_still_set_their_keys() -> None:
    assert _build("broker", {"CARPOOL_FRONTEND": "tcp://127.0.0.1:7000"}).frontend.endswith("7000")
    assert _build("worker", {"CARPOOL_BROKER": "tcp://127.0.0.1:7001"}).broker.endswith("7001")


@pytest.mark.parametrize(
    ("role", "environ", "says"),
    [
        ("broker", {"CARPOOL_BROKER_BATCHING_MAX_BATCH": "0"}, "max_batch must be in 1..4096"),
        ("broker", {"CARPOOL_BROKER_LIVENESS": "many"}, "CARPOOL_BROKER_LIVENESS='many'"),
        ("broker", {"CARPOOL_BROKER_LIVENESS": "2.5"}, "liveness: expected int, got float"),
        ("worker", {"CARPOOL_WORKER_SLOTS": "0"}, "slots must be in 1..1024"),
        ("worker", {"CARPOOL_WORKER_HUNG_BATCH_S": "-1"}, "hung_batch_s must be in 0..86400"),
    ],
)
def test_a_bad_value_names_the_key_the_rule_and_the_variable(
    role: str, environ: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _build(role, environ)
    assert says in str(caught.value)
    assert next(iter(environ)) in str(caught.value)


def test_set_names_an_unknown_key_and_the_closest_one() -> None:
    with pytest.raises(ConfigError, match=r"--set batching.max_bach=3.*batching\.max_batch"):
        _build("broker", {}, "--set", "batching.max_bach=3")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        _build("worker", {}, "--set", "slots")


def test_an_unknown_variable_is_an_error_naming_it() -> None:
    known = roles.known_variables()
    assert not roles.check_environment(
        {"CARPOOL_LOG_LEVEL": "INFO", "HOME": "/root", **dict.fromkeys(known, "")}
    )
    with pytest.raises(ConfigError) as caught:
        roles.check_environment(
            {"CARPOOL_MAX_BATCH": "3", "CARPOOL_BROKER_BATCHING_MAX_BATCH": "3"}
        )
    assert "CARPOOL_MAX_BATCH: unknown" in str(caught.value)
    assert "CARPOOL_BROKER_BATCHING_MAX_BATCH" in str(caught.value)  # the hint
    assert str(caught.value).count("unknown carpool") == 1


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("CARPOOL_BROKER_MAX_BACH", "CARPOOL_BROKER_BATCHING_MAX_BATCH"),  # a role's prefix
        ("CARPOOL_WORKER_SLOT", "CARPOOL_WORKER_SLOTS"),
        ("CARPOOL_LOGLEVEL", "CARPOOL_LOG_LEVEL"),  # near a process variable
        ("CARPOOL_FRONTEN", "CARPOOL_FRONTEND"),  # near an older name
        ("CARPOOL_MAX_BATCH", "CARPOOL_BROKER_BATCHING_MAX_BATCH"),  # the key alone
    ],
)
def test_a_name_meant_as_a_setting_is_refused_naming_the_setting(name: str, meant: str) -> None:
    with pytest.raises(ConfigError) as caught:
        roles.check_environment({name: "1"})
    said = str(caught.value)
    assert f"{name}: unknown carpool environment variable (did you mean {meant}" in said


def test_a_role_prefix_refuses_a_name_near_no_setting() -> None:
    with pytest.raises(ConfigError, match=r"CARPOOL_WORKER_XYZZY: unknown carpool [^(]*$"):
        roles.check_environment({"CARPOOL_WORKER_XYZZY": "1"})


def test_other_carpool_names_are_returned_to_warn_of_not_refused() -> None:
    """A user's own variables under CARPOOL_ (a venv, a document, a home) are no setting,
    nor near one: returned, for a warning, with every refused name still refused."""
    users = {"CARPOOL_VENV": "/x", "CARPOOL_PROTOCOL_DOC": "/y", "CARPOOL_HOME": "/z"}
    environ = {**users, "CARPOOL_LOG_LEVEL": "INFO", "CARPOOL_FRONTEND": "tcp://127.0.0.1:1"}
    assert roles.check_environment(environ) == sorted(users)
    with pytest.raises(ConfigError) as caught:
        roles.check_environment({**users, "CARPOOL_LOGLEVEL": "DEBUG"})
    assert "CARPOOL_LOGLEVEL" in str(caught.value)
    assert "CARPOOL_VENV" not in str(caught.value)


def test_every_roles_prefix_is_its_own() -> None:
    """A name under a role's prefix is refused whatever follows; the same name is a
    user's own where no role has that prefix."""
    assert check_variables({"CARPOOL_SITE_ID": "7"}, [], ["broker"]) == ["CARPOOL_SITE_ID"]
    with pytest.raises(ConfigError, match="CARPOOL_SITE_ID: unknown"):
        check_variables({"CARPOOL_SITE_ID": "7"}, [], ["broker", "site"])


def test_every_variable_carpool_reads_is_known() -> None:
    """The names the code reads itself (grep CARPOOL_ in src): process or role settings."""
    import re

    src = Path(roles.__file__).parent
    read = set()
    for path in src.rglob("*.py"):
        read |= set(re.findall(r"[\"'](CARPOOL_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    assert {"CARPOOL_LOG_LEVEL", "CARPOOL_BROKER", "CARPOOL_WEDGE_FILE"} <= read
    known = roles.known_variables() | set(PROCESS_VARIABLES)
    assert read <= known, read - known


def test_dataclass_sections_are_walked() -> None:
    paths = setting_paths(BrokerConfig)
    assert ("batching", "max_wait_s") in paths
    assert ("curve", "operators") in paths
    assert ("models",) in paths  # (a table of tables: one value)
    assert ("models",) in setting_paths(WorkerConfig)
    assert len(dataclasses.fields(WorkerConfig)) == len(setting_paths(WorkerConfig))
