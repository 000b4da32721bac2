"""[models.<name>] tables override only the keys they set; every other key comes from
[batching] as finally configured (the file plus the command line's flags)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from carpool import cli, roles
from carpool.broker.config import (
    BatchingConfig,
    BatchingOverride,
    BrokerConfig,
    unused_settings,
)
from carpool.broker.core import BrokerCore
from carpool.broker.policy import FixedPolicy
from carpool.common.config import from_mapping, load_toml
from carpool.common.errors import ConfigError
from tests.unit.broker.harness import C1, T0, W1, Broker, batches, model_spec

# A model table that sets only max_batch.
PARTIAL_MODEL_TOML = """
[batching]
policy = "fixed"
max_wait_s = 0.05

[models.synthetic]
max_batch = 4
"""


def load(tmp_path: Path, text: str) -> BrokerConfig:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return from_mapping(BrokerConfig, load_toml(path))


def test_a_model_table_inherits_the_keys_it_leaves_unset(tmp_path: Path) -> None:
    config = load(tmp_path, PARTIAL_MODEL_TOML)
    assert config.batching_for("synthetic") == BatchingConfig(
        max_batch=4, max_wait_s=0.05, policy="fixed"
    )
    assert config.batching_for("other") == BatchingConfig(max_wait_s=0.05, policy="fixed")
    assert config.models == {"synthetic": BatchingOverride(max_batch=4)}


def broker_config_from_cli(argv: list[str]) -> BrokerConfig:
    """The BrokerConfig ``carpool broker ARGV`` would serve with, in an empty environment."""
    args = cli.build_parser().parse_args(["broker", *argv])
    return roles.broker_config(args, {})


def test_command_line_flags_reach_models_with_a_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(
        PARTIAL_MODEL_TOML + '[models.pinned]\npolicy = "carpool"\nmax_wait_s = 0.001\n'
    )
    flags = ["--policy", "seed", "--max-wait-ms", "20", "--max-batch", "16"]
    config = broker_config_from_cli(["--config", str(path), *flags])
    assert config.batching == BatchingConfig(max_batch=16, max_wait_s=0.02, policy="seed")
    # Unset keys follow the flags; keys the model's table sets stay as set.
    assert config.batching_for("synthetic") == BatchingConfig(
        max_batch=4, max_wait_s=0.02, policy="seed"
    )
    assert config.batching_for("pinned") == BatchingConfig(
        max_batch=16, max_wait_s=0.001, policy="carpool"
    )


def test_the_broker_core_batches_the_model_with_the_inherited_settings(tmp_path: Path) -> None:
    core = BrokerCore(load(tmp_path, PARTIAL_MODEL_TOML))
    policy = core.fleet.policy("synthetic")
    assert isinstance(policy, FixedPolicy)
    assert (policy.max_batch, policy.max_wait_s) == (4, 0.05)
    b = Broker(core)
    b.ready(T0, W1, model_spec("synthetic"), slots=1)
    assert core.snapshot()["workers"][0]["lanes"]["synthetic"]["b_max"] == 4
    assert batches(b.request(T0, 1, C1, model="synthetic")) == []
    # The fixed rule waits the inherited 50 ms T_max (not the 5 ms default, and not the
    # carpool policy's "leave at once where batching buys nothing").
    assert batches(b.tick(T0 + 0.01)) == []
    assert batches(b.tick(T0 + 0.049)) == []
    (sent,) = batches(b.tick(T0 + 0.051))
    assert sent.batch.model == "synthetic"


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"policy": "fixd"}, "models.m.policy must be one of carpool, fixed, seed, got 'fixd'"),
        ({"max_wait_s": 61}, "models.m.max_wait_s must be in 0..60, got 61"),
        ({"max_batch": 0}, "models.m.max_batch must be in 1..4096, got 0"),
        ({"learning_rate": 0}, "models.m.learning_rate must be in (0, 1]"),
        ({"max_batch": "4"}, "BrokerConfig.models.m.max_batch: expected int, got str"),
        ({"max_size": 4}, "BrokerConfig.models.m.max_size: unknown setting"),
    ],
)
def test_a_bad_model_table_is_reported_with_its_key(table: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(BrokerConfig, {"models": {"m": table}})
    assert expected in str(info.value)


def test_an_override_knows_every_batching_key() -> None:
    names = [f.name for f in dataclasses.fields(BatchingConfig)]
    assert [f.name for f in dataclasses.fields(BatchingOverride)] == names
    everything = BatchingOverride(**dataclasses.asdict(BatchingConfig(policy="seed")))
    assert everything.over(BatchingConfig(max_batch=99)) == BatchingConfig(policy="seed")


def test_a_whole_batching_config_per_model_overrides_every_key() -> None:
    """A ``models`` entry may be a whole BatchingConfig (every key set): it is
    taken as an override of every key, and a non-table entry is a ConfigError."""
    # A BatchingConfig where the field's type says BatchingOverride, on purpose: the
    # config converts it.
    config = BrokerConfig(models={"m": BatchingConfig(max_batch=4)})  # type: ignore[dict-item]
    assert config.batching_for("m") == BatchingConfig(max_batch=4)
    assert config.models["m"] == BatchingOverride(**dataclasses.asdict(BatchingConfig(max_batch=4)))
    with pytest.raises(ConfigError, match=r"models\.m must be a table"):
        BrokerConfig(models={"m": 4})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("toml", "unused"),
    [
        ("[batching]\ntarget_rho = 0.7\n", ["batching.target_rho"]),  # carpool reads none
        ('[batching]\npolicy = "seed"\ntarget_rho = 0.7\n', []),
        ('[batching]\npolicy = "fixed"\ntarget_rho = 0.5\n', []),  # the default: no change
        # A seed table that leaves the key to [batching] reads it; one that sets its own
        # does not.
        ('[batching]\nlearning_rate = 0.2\n[models.m]\npolicy = "seed"\n', []),
        (
            '[batching]\nlearning_rate = 0.2\n[models.m]\npolicy = "seed"\nlearning_rate = 0.3\n',
            ["batching.learning_rate"],
        ),
        (
            '[models.m]\nadapt_interval_s = 1.0\n[models.s]\npolicy = "seed"\ntarget_rho = 0.6\n',
            ["models.m.adapt_interval_s"],
        ),
    ],
)
def test_a_seed_policy_key_that_changes_nothing_is_named_and_logged(
    tmp_path: Path, toml: str, unused: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(toml)
    with caplog.at_level("WARNING", logger="carpool.roles"):
        config = broker_config_from_cli(["--config", str(path)])
    assert unused_settings(config) == unused
    warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert [w.split(" ")[0] for w in warned] == unused
