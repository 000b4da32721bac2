"""WorkerConfig and ModelConfig, and what ``carpool worker`` flags make of them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from carpool.cli import build_parser, worker_config
from carpool.common.config import MAX_BATCH_CEILING
from carpool.common.errors import ConfigError
from carpool.worker.config import ModelConfig, TensorRTConfig, model_from_arg
from carpool.worker.factory import engine_factory, worker_server
from carpool.worker.models import locate
from carpool.worker.repository import builtin


def _worker_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


# --------------------------------------------------------------------------- --model


def test_a_catalogue_name_is_a_catalogue_model() -> None:
    assert model_from_arg("orientation") == ModelConfig(name="orientation")


def test_an_onnx_file_is_served_under_its_stem(tmp_path: Path) -> None:
    onnx = tmp_path / "my.onnx"
    onnx.write_bytes(b"")
    assert model_from_arg(str(onnx)) == ModelConfig(name="my", path=str(onnx))


def test_a_relative_onnx_file_is_a_path_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my.onnx").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert model_from_arg("my.onnx") == ModelConfig(name="my", path="my.onnx")


def test_name_equals_path_names_the_model(tmp_path: Path) -> None:
    onnx = tmp_path / "my.onnx"
    onnx.write_bytes(b"")
    assert model_from_arg(f"det={onnx}") == ModelConfig(name="det", path=str(onnx))


def test_a_path_with_an_equals_sign_is_a_path(tmp_path: Path) -> None:
    onnx = tmp_path / "a=b" / "my.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"")
    assert model_from_arg(str(onnx)) == ModelConfig(name="my", path=str(onnx))


@pytest.mark.parametrize("arg", ["{tmp}/nope.onnx", "x={tmp}/nope.onnx", "nope.onnx", "{tmp}"])
def test_a_path_that_is_no_file_is_a_config_error(arg: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no ONNX file"):
        model_from_arg(arg.format(tmp=tmp_path))


def test_the_unknown_model_error_says_a_path_works() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'my'.*--model /path/to/model\.onnx"):
        locate("my")


# --------------------------------------------------------------------------- flags together


def test_model_and_synthetic_are_both_served() -> None:
    """--model and --synthetic together serve both models."""
    config = worker_config(_worker_args("--model", "orientation", "--synthetic", "5", "0.5"))
    assert [(m.name, m.engine) for m in config.models] == [
        ("orientation", "onnxruntime"),
        ("synthetic", "synthetic"),
    ]
    assert config.models[1].fixed_cost_s == pytest.approx(0.005)


def test_model_flags_replace_the_files_models(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('name = "w"\n[[models]]\nname = "ppocr-cls"\nmax_batch = 16\n')
    config = worker_config(_worker_args("--config", str(toml), "--synthetic", "1", "0"))
    assert config.name == "w"
    assert [m.name for m in config.models] == ["synthetic"]


def test_max_batch_and_threads_apply_to_the_files_models(tmp_path: Path) -> None:
    """With --config and no --model, --max-batch and --threads apply to each model of
    the file."""
    toml = tmp_path / "w.toml"
    toml.write_text(
        '[[models]]\nname = "ppocr-cls"\nmax_batch = 16\n'
        '[[models]]\nname = "s"\nengine = "synthetic"\nmax_batch = 32\n'
    )
    args = _worker_args("--config", str(toml), "--max-batch", "2", "--threads", "3")
    config = worker_config(args)
    assert [(m.name, m.max_batch, m.intra_op_threads) for m in config.models] == [
        ("ppocr-cls", 2, 3),
        ("s", 2, 3),
    ]


def test_without_flags_the_files_settings_stand(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "ppocr-cls"\nmax_batch = 16\nintra_op_threads = 2\n')
    (model,) = worker_config(_worker_args("--config", str(toml))).models
    assert (model.max_batch, model.intra_op_threads) == (16, 2)


def test_flag_models_keep_their_defaults() -> None:
    config = worker_config(_worker_args("--model", "orientation", "--synthetic", "1", "0"))
    # max_batch: what the engine takes (a symbolic batch dim: any), so the broker's binds.
    expected = [(MAX_BATCH_CEILING, 1), (MAX_BATCH_CEILING, 1)]
    assert [(m.max_batch, m.intra_op_threads) for m in config.models] == expected


def test_max_batch_applies_to_flag_models() -> None:
    config = worker_config(
        _worker_args("--model", "orientation", "--synthetic", "1", "0", "--max-batch", "4")
    )
    assert [m.max_batch for m in config.models] == [4, 4]


def test_synthetic_name_without_synthetic_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--synthetic-name"):
        worker_config(_worker_args("--model", "orientation", "--synthetic-name", "s"))


def test_providers_come_from_the_toml_and_may_not_be_empty() -> None:
    from carpool.common.config import from_mapping

    got = from_mapping(
        ModelConfig, {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    )
    assert got.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert ModelConfig().providers == ("CPUExecutionProvider",)
    with pytest.raises(ConfigError, match="providers must name"):
        ModelConfig(providers=())


def test_input_rules_come_from_the_toml_and_reach_the_engine(tmp_path: Path) -> None:
    """[models.inputs.NAME] (protocol §8.1); a catalogue model's own rules and padding
    (ppocr-det: padded to multiples of 32) apply to it, not to a file of its own."""
    from carpool.common.padding import PadRule
    from carpool.common.shape_rules import ShapeRule

    toml = tmp_path / "w.toml"
    toml.write_text(
        '[[models]]\nname = "ppocr-det"\n'
        '[[models]]\nname = "big-det"\npath = "' + str(locate("ppocr-det")) + '"\n'
        "[models.inputs.x]\nmax_shape = [-1, 3, 1536, 1536]\nmultiple_of = [1, 1, 64, 64]\n"
        '[[models]]\nname = "s"\nengine = "synthetic"\nitem_shape = [-1]\n'
        "[models.inputs.x]\nmin_shape = [1, 8]\n"
    )
    det, big, synthetic = worker_config(_worker_args("--config", str(toml))).models
    assert det.inputs == {}
    det_info = engine_factory(det)().info
    assert det_info.io.rules == ()
    assert det_info.io.pads == (PadRule(multiple_of=(1, 32, 32)),)
    assert engine_factory(big)().info.io.rules == (
        ShapeRule(max_shape=(-1, 3, 1536, 1536), multiple_of=(1, 1, 64, 64)),
    )
    assert engine_factory(synthetic)().info.io.rules == (ShapeRule(min_shape=(1, 8)),)
    # A model of its own file has no catalogue rule.
    (own,) = worker_config(_worker_args("--model", str(locate("ppocr-det")))).models
    assert engine_factory(own)().info.io.rules == ()
    assert engine_factory(own)().info.io.pads == ()


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ("[models.inputs.image]\nmultiple_of = [1, 1, 32, 32]\n", r"inputs\.image: no input"),
        ("[models.inputs.x]\nmultiple_of = [1, 32]\n", "inputs.x.multiple_of: has 2 entries"),
        ("[models.inputs.x]\nmultiple_of = [1, 1, 0, 32]\n", "entries must be ints >= 1"),
    ],
)
def test_input_rules_that_do_not_fit_the_model_are_config_errors(
    tmp_path: Path, table: str, match: str
) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "ppocr-det"\n' + table)
    (model,) = worker_config(_worker_args("--config", str(toml))).models
    with pytest.raises(ConfigError, match=match):
        engine_factory(model)()


def test_input_rules_of_the_wrong_type_are_config_errors(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "ppocr-det"\n[models.inputs.x]\nmultiple_of = 32\n')
    with pytest.raises(ConfigError, match=r"models\[0\].inputs.x.multiple_of: expected a list"):
        worker_config(_worker_args("--config", str(toml)))


def test_max_batch_below_the_files_preferred_sizes_drops_those_sizes(tmp_path: Path) -> None:
    """Not a ConfigError ("preferred_batch sizes must lie in 1..max_batch"): the sizes
    are advice to the broker, the flag is the operator's word."""
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "ppocr-cls"\nmax_batch = 16\npreferred_batch = [4, 8]\n')
    (model,) = worker_config(_worker_args("--config", str(toml), "--max-batch", "6")).models
    assert (model.max_batch, model.preferred_batch) == (6, (4,))
    (model,) = worker_config(_worker_args("--config", str(toml), "--threads", "2")).models
    assert (model.max_batch, model.preferred_batch) == (16, (4, 8))


def test_a_worker_without_a_name_is_named_by_its_host_and_process() -> None:
    """Without --name, each worker has a name of its own in STATS and the logs, not a
    shared "worker"."""
    import os
    import socket

    from carpool.worker.config import WorkerConfig

    assert worker_config(_worker_args()).name == ""
    model = ModelConfig.synthetic("s", 0, 0, 4)
    server = worker_server(WorkerConfig(models=(model,)))
    try:
        assert server.core.name == f"{socket.gethostname()}-{os.getpid()}"
    finally:
        server.close()
    named = worker_server(WorkerConfig(name="cpu-0", models=(model,)))
    try:
        assert named.core.name == "cpu-0"
    finally:
        named.close()


def test_a_table_naming_a_built_in_model_sets_its_tensorrt_keys_over_the_built_ins() -> None:
    base = builtin().models["ppocr-rec"].config
    mine = ModelConfig(name="ppocr-rec", engine="tensorrt", tensorrt=TensorRTConfig(build=True))
    model = mine.over(base)
    assert model.tensorrt == TensorRTConfig(max_profiles=10, batches=("1:8:8",), build=True)
    assert model.folder == base.folder
