"""config.py: mappings into frozen dataclasses, every problem reported at once."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from carpool.broker.config import BatchingConfig, BatchingOverride, BrokerConfig
from carpool.common.config import check, from_mapping, load_toml, out_of_range, signs
from carpool.common.errors import ConfigError
from carpool.worker.config import ModelConfig, WorkerConfig


def problems_of(cls: type[Any], data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        from_mapping(cls, data)
    return str(info.value)


def test_empty_mapping_gives_defaults() -> None:
    assert from_mapping(BrokerConfig, {}) == BrokerConfig()
    assert from_mapping(WorkerConfig, {}) == WorkerConfig()


def test_scalars_are_set() -> None:
    cfg = from_mapping(
        BrokerConfig,
        {"frontend": "tcp://*:1", "max_queued": 7, "liveness": 5, "default_timeout_s": 2.5},
    )
    assert cfg.frontend == "tcp://*:1"
    assert cfg.max_queued == 7
    assert cfg.liveness == 5
    assert cfg.default_timeout_s == 2.5


def test_ints_become_floats() -> None:
    cfg = from_mapping(BrokerConfig, {"default_timeout_s": 5, "batching": {"max_wait_s": 0}})
    assert cfg.default_timeout_s == 5.0
    assert type(cfg.default_timeout_s) is float
    assert type(cfg.batching.max_wait_s) is float


def test_floats_do_not_become_ints() -> None:
    msg = problems_of(BrokerConfig, {"max_queued": 5.0})
    assert "BrokerConfig.max_queued: expected int, got float" in msg


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"max_queued": True}, "BrokerConfig.max_queued: expected int, got bool"),
        ({"default_timeout_s": True}, "BrokerConfig.default_timeout_s: expected float, got bool"),
        ({"frontend": 5555}, "BrokerConfig.frontend: expected str, got int"),
        ({"liveness": "3"}, "BrokerConfig.liveness: expected int, got str"),
        ({"batching": 5}, "BrokerConfig.batching: expected a table"),
        ({"batching": {"max_batch": "8"}}, "BrokerConfig.batching.max_batch: expected int"),
        ({"models": [1]}, "BrokerConfig.models: expected a table"),
        ({"models": {"m": 3}}, "BrokerConfig.models.m: expected a table"),
        ({"bogus": 1}, "BrokerConfig.bogus: unknown setting"),
        ({"batching": {"max_size": 1}}, "BrokerConfig.batching.max_size: unknown setting"),
        ({"liveness": 0}, "liveness must be in 1..100"),
        ({"watchdog_factor": 0.5}, "watchdog_factor must be in 1..1000"),
        ({"watchdog_slack_s": 0}, "watchdog_slack_s must be in 0.001..3600"),
        ({"watchdog_slack_s": "1"}, "BrokerConfig.watchdog_slack_s: expected float"),
        ({"batching": {"max_batch": 0}}, "max_batch must be in 1..4096, got 0"),
        ({"models": {"m": {"max_wait_s": 61}}}, "models.m.max_wait_s must be in 0..60"),
    ],
)
def test_broker_config_problems(data: dict[str, Any], expected: str) -> None:
    assert expected in problems_of(BrokerConfig, data)


def test_unknown_key_lists_the_known_ones() -> None:
    msg = problems_of(BrokerConfig, {"frontnd": "x"})
    assert "unknown setting" in msg
    for known in ("frontend", "backend", "batching", "max_attempts"):
        assert known in msg


def test_several_problems_in_one_error() -> None:
    msg = problems_of(
        BrokerConfig,
        {
            "bogus": 1,
            "max_queued": "many",
            "batching": {"max_batch": 0, "extra": True},
            "liveness": 0,
            "max_attempts": 11,
            "max_frame_mib": -1,
        },
    )
    assert msg.startswith("invalid configuration:")
    for part in (
        "BrokerConfig.bogus: unknown setting",
        "BrokerConfig.max_queued: expected int, got str",
        "BrokerConfig.batching.extra: unknown setting",
        "max_batch must be in 1..4096",
        "liveness must be in 1..100",
        "max_attempts must be in 1..10",
        "max_frame_mib must be in 0..1048576",
    ):
        assert part in msg, part
    assert len(msg.splitlines()) >= 5


@pytest.mark.parametrize(
    ("heartbeat_s", "timeout_s", "problem"),
    [
        (0.0004, 0.0005, "peer_heartbeat_s must be 0 (off) or in 0.001..3600"),  # 0 ms
        (-1.0, 30.0, "peer_heartbeat_s must be 0 (off) or in 0.001..3600"),
        (10.0, 10.0, "peer_timeout_s must be above peer_heartbeat_s"),
        (10.0, 4000.0, "peer_timeout_s must be above peer_heartbeat_s, at most 3600"),
    ],
)
def test_peer_heartbeats_out_of_range(heartbeat_s: float, timeout_s: float, problem: str) -> None:
    config = {"peer_heartbeat_s": heartbeat_s, "peer_timeout_s": timeout_s}
    assert problem in problems_of(BrokerConfig, config)


def test_peer_heartbeats_off() -> None:
    assert BrokerConfig(peer_heartbeat_s=0.0, peer_timeout_s=0.0).peer_heartbeat_s == 0.0


def test_where_prefix() -> None:
    with pytest.raises(ConfigError, match=r"broker\.bogus: unknown setting"):
        from_mapping(BrokerConfig, {"bogus": 1}, "broker")


def test_nested_dataclass_and_dict_of_dataclasses() -> None:
    cfg = from_mapping(
        BrokerConfig,
        {
            "batching": {"max_batch": 4, "max_wait_s": 0.01},
            "models": {"a": {"max_batch": 2}, "b": {"max_wait_s": 1}},
        },
    )
    assert cfg.batching == BatchingConfig(4, 0.01)
    # A model's table sets only its own keys; the rest come from [batching].
    assert cfg.models == {"a": BatchingOverride(max_batch=2), "b": BatchingOverride(max_wait_s=1.0)}
    assert type(cfg.models["b"].max_wait_s) is float
    assert cfg.batching_for("a") == BatchingConfig(2, 0.01)
    assert cfg.batching_for("b") == BatchingConfig(4, 1.0)
    assert cfg.batching_for("zzz") == cfg.batching


def test_tuple_of_dataclasses() -> None:
    cfg = from_mapping(
        WorkerConfig,
        {
            "name": "edge-1",
            "slots": 3,
            "heartbeat_s": 1,
            "models": [
                {"name": "a", "engine": "synthetic", "item_shape": [3, 4], "preferred_batch": [2]},
                {"name": "b", "path": "/m.onnx", "per_sample_s": 0},
            ],
        },
    )
    assert cfg.name == "edge-1"
    assert cfg.slots == 3
    assert type(cfg.heartbeat_s) is float
    assert isinstance(cfg.models, tuple)
    assert [type(m) for m in cfg.models] == [ModelConfig, ModelConfig]
    a, b = cfg.models
    assert a.item_shape == (3, 4)
    assert isinstance(a.item_shape, tuple)
    assert a.preferred_batch == (2,)
    assert a.engine == "synthetic"
    assert b.path == "/m.onnx"
    assert type(b.per_sample_s) is float


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"models": {"name": "a"}}, "WorkerConfig.models: expected a list"),
        ({"models": []}, "1..256 [[models]] entries are needed"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "model names must be unique"),
        ({"slots": 0, "liveness": 0}, "slots must be in 1..1024; liveness must be in 1..100"),
        ({"models": [{"max_batch": "8"}]}, "WorkerConfig.models[0].max_batch: expected int"),
        ({"models": [{"item_shape": 16}]}, "WorkerConfig.models[0].item_shape: expected a list"),
        ({"models": [{"nme": "a"}]}, "WorkerConfig.models[0].nme: unknown setting"),
        ({"shm_output_mib": -1}, "shm_output_mib must be in 0..1048576"),
        ({"shm_output_mode": 0o1777}, "shm_output_mode must be a file mode"),
        ({"shm_output_mode": 0o660}, "never write it"),
        # Settings whose READY the broker would refuse (the worker then never joins):
        ({"name": "w" * 257}, "worker: name must have at most 256 characters"),
        ({"models": [{"name": ""}]}, "model '': name must have 1..256 characters"),
        ({"models": [{"name": "m", "engine": "synthetic", "item_shape": [0]}]}, "item_shape"),
        ({"models": [{"name": "m", "engine": "synthetic", "item_shape": [1] * 8}]}, "item_shape"),
        ({"models": [{"name": "m", "engine": "synthetic", "dtype": "complex64"}]}, "dtype must"),
        ({"models": [{"name": f"m{i}"} for i in range(257)]}, "1..256 [[models]] entries"),
    ],
)
def test_worker_config_problems(data: dict[str, Any], expected: str) -> None:
    assert expected in problems_of(WorkerConfig, data)


@pytest.mark.parametrize(
    "models",
    [
        [{"name": "a", "engine": "tensorflow"}],
        [{"name": "a", "max_batch": 0}],
        ["not a table"],
        [{"name": "a", "preferred_batch": ["x"]}],
    ],
    ids=["bad-engine", "bad-max-batch", "not-a-table", "bad-tuple-item"],
)
def test_invalid_model_entry_is_a_config_error(models: list[Any]) -> None:
    msg = problems_of(WorkerConfig, {"models": models, "slots": 0})
    assert "slots must be in 1..1024" in msg


def test_load_toml(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(
        'frontend = "tcp://*:6000"\ndefault_timeout_s = 3\n'
        "[batching]\nmax_batch = 16\n[models.resnet]\nmax_wait_s = 0.002\n"
    )
    data = load_toml(path)
    cfg = from_mapping(BrokerConfig, data)
    assert cfg.frontend == "tcp://*:6000"
    assert cfg.default_timeout_s == 3.0
    assert cfg.batching.max_batch == 16
    assert cfg.models == {"resnet": BatchingOverride(max_wait_s=0.002)}
    assert cfg.batching_for("resnet") == BatchingConfig(16, 0.002)


def test_load_toml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_toml(tmp_path / "nope.toml")


def test_load_toml_malformed(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("this is = = not toml\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)


@pytest.mark.parametrize(
    "content",
    [b"# cam\xe9ra\nmax_queued = 100\n", b"\xff\xfe\n"],
    ids=["latin-1-comment", "binary"],
)
def test_load_toml_not_utf8(tmp_path: Path, content: bytes) -> None:
    """A ConfigError naming the file (a usage error for carpool broker/worker --config),
    not a UnicodeDecodeError traceback."""
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"config {path} is not UTF-8 text")) as info:
        load_toml(path)
    assert "\n" not in str(info.value)


def test_check() -> None:
    check([], "here")
    with pytest.raises(ConfigError, match=r"^here: a; b$"):
        check(["a", "b"], "here")


def test_worker_shared_memory_settings_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text("shm_output_mib = 16\nshm_output_mode = 0o640\n")
    cfg = from_mapping(WorkerConfig, load_toml(path))
    assert (cfg.shm_output_mib, cfg.shm_output_mode) == (16, 0o640)
    assert (WorkerConfig().shm_output_mib, WorkerConfig().shm_output_mode) == (64, 0o600)


def test_out_of_range_names_each_field_outside_its_bounds_in_order() -> None:
    @dataclasses.dataclass
    class Limits:
        a: int = 0
        b: float = 0.5
        c: int = 11

    bounds = {"c": (1, 10), "b": (0.001, 3600), "a": (1, 1 << 24)}
    assert out_of_range(Limits(), bounds) == [
        "c must be in 1..10",
        "a must be in 1..16777216",
    ]
    assert out_of_range(Limits(a=1, c=10), bounds) == []


def test_signs_names_each_field_not_positive_then_each_negative_in_the_order_given() -> None:
    @dataclasses.dataclass
    class Settings:
        rate: float = 0.0
        count: int = 3
        gap: float = float("nan")
        wait: float = -1.0
        floor: int = 0

    problems = signs(Settings(), positive=("rate", "count", "gap"), non_negative=("wait", "floor"))
    assert problems == [
        "rate must be > 0, got 0.0",
        "gap must be > 0, got nan",
        "wait must be >= 0, got -1.0",
    ]
    assert signs(Settings(rate=1.0, gap=2.0, wait=0.0), positive=("rate", "gap")) == []
