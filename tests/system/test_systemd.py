"""The unit files pass systemd-analyze, and the example configs load."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.broker.config import BrokerConfig, CurveConfig
from carpool.common.config import from_mapping, load_toml
from carpool.worker.config import WorkerConfig
from carpool.worker.factory import engine_factory

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"


def test_broker_example_loads() -> None:
    config = from_mapping(BrokerConfig, load_toml(SYSTEMD / "broker.toml.example"))
    assert config.batching_for("orientation").max_batch == 16
    assert config.batching_for("other").max_batch == 8


def test_broker_example_shows_the_defaults_but_where_it_says_not() -> None:
    """Its first line says so: all but the endpoints, [curve] and the [models] example."""
    import dataclasses

    config = from_mapping(BrokerConfig, load_toml(SYSTEMD / "broker.toml.example"))
    assert config.curve.enabled  # its sockets face the network
    curve = dataclasses.replace(config.curve, enabled=False, server_key="", clients="", workers="")
    assert curve == CurveConfig()
    shown = dataclasses.replace(
        config,
        frontend=BrokerConfig().frontend,
        backend=BrokerConfig().backend,
        models={},
        curve=CurveConfig(),
    )
    assert shown == BrokerConfig()


def test_worker_example_loads() -> None:
    config = from_mapping(WorkerConfig, load_toml(SYSTEMD / "worker.toml.example"))
    assert [m.name for m in config.models] == ["orientation", "ppocr-cls", "synthetic"]
    assert config.models[2].engine == "synthetic"
    assert config.models[2].item_shape == (16,)


def test_worker_examples_commented_repository_names_one() -> None:
    text = (SYSTEMD / "worker.toml.example").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("# repository = ")]
    config = from_mapping(WorkerConfig, tomllib.loads(line.removeprefix("# ")))
    assert config.repository == "/var/lib/carpool/models"


def test_worker_examples_commented_input_rules_load_and_fit_ppocr_cls() -> None:
    from carpool.common.shape_rules import ShapeRule

    text = (SYSTEMD / "worker.toml.example").read_text()
    lines = text.splitlines()
    start = lines.index("# [models.inputs.x]")
    for i in range(start, start + 4):
        lines[i] = lines[i].removeprefix("# ")
    config = from_mapping(WorkerConfig, tomllib.loads("\n".join(lines)))
    cls = config.models[1]
    rule = ShapeRule((1, 3, 48, 16), (-1, 3, 48, 2048), (1, 1, 1, 8))
    assert {name: declared.rule() for name, declared in cls.inputs.items()} == {"x": rule}
    assert engine_factory(cls)().info.io.rules == (rule,)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("unit", ["carpool-broker.service", "carpool-worker@.service"])
def test_unit_files_verify(unit: str, tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this environment's carpool script.
    carpool = Path(sys.executable).with_name("carpool")
    assert carpool.exists()
    text = (SYSTEMD / unit).read_text().replace("/opt/carpool/venv/bin/carpool", str(carpool))
    target = tmp_path / (unit.replace("@.", "@test.") if "@" in unit else unit)
    target.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if str(target.name) in line or "carpool" in line
    ]
    assert result.returncode == 0, result.stdout + result.stderr
    assert not problems, result.stdout + result.stderr


#: The highest ``systemd-analyze security --offline=yes`` exposure each unit may score
#: (0 safest, 10 exposed; systemd 252 scores them 1.5 and 1.9). docs/deploy.md states them.
EXPOSURE = {"carpool-broker.service": 1.5, "carpool-worker@.service": 1.9}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("unit", sorted(EXPOSURE))
def test_unit_hardening_keeps_the_exposure_score_low(unit: str, tmp_path: Path) -> None:
    import re

    target = tmp_path / unit.replace("@.", "@x.")
    target.write_text((SYSTEMD / unit).read_text())
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= EXPOSURE[unit], result.stdout


@pytest.mark.parametrize("unit", sorted(EXPOSURE))
def test_units_are_notify_units_with_a_watchdog(unit: str) -> None:
    settings = [line.split("=", 1) for line in (SYSTEMD / unit).read_text().splitlines()]
    values = {k: v for k, *rest in settings for v in rest}
    assert values["Type"] == "notify"
    assert values["NotifyAccess"] == "main"
    assert values["Restart"] == "on-failure"
    assert values["WatchdogSec"].endswith("s")


def test_the_docs_state_the_exposure_scores() -> None:
    text = (SYSTEMD.parent / "docs" / "deploy.md").read_text()
    for unit, score in EXPOSURE.items():
        assert f"`{unit}` | {score}" in text, unit


def test_worker_example_leaves_the_orientation_limit_to_its_engine() -> None:
    from carpool.common.config import MAX_BATCH_CEILING

    config = from_mapping(WorkerConfig, load_toml(SYSTEMD / "worker.toml.example"))
    assert config.models[0].max_batch == MAX_BATCH_CEILING
    assert config.hung_batch_s == WorkerConfig().hung_batch_s


@pytest.mark.parametrize(
    ("example", "role"), [("broker.toml.example", "broker"), ("worker.toml.example", "worker")]
)
def test_every_key_of_the_examples_has_a_variable(example: str, role: str) -> None:
    """The example files' keys, each under its variable (names from the dataclasses)."""
    from carpool.common.settings import variables
    from carpool.roles import role_classes

    names = set(variables(role, role_classes()[role]).values())
    data = load_toml(SYSTEMD / example)
    keys: set[tuple[str, ...]] = {
        (k,) for k, v in data.items() if not isinstance(v, dict) or k == "models"
    }
    keys |= {
        (k, sub) for k, v in data.items() if isinstance(v, dict) and k != "models" for sub in v
    }
    assert keys <= names, keys - names
    assert len(keys) >= 10
