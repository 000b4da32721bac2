"""worker/repository.py: model repositories read from folders — their models, the problems
of broken ones (each naming the file, the key and the rule), and how worker.toml's
[[models]] tables and --model pick models from one."""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

import pytest

from carpool.cli import build_parser, worker_config
from carpool.common.errors import ConfigError
from carpool.common.padding import CropAxis, PadRule
from carpool.worker.config import SourceConfig, TensorRTConfig
from carpool.worker.factory import engine_factory
from carpool.worker.models import locate
from carpool.worker.repository import BUILTIN_ROOT, builtin, load, merged, scan
from carpool.worker.shapes import CropConfig, InputConfig, OutputConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]


def add_model(root: Path, name: str, toml: str, onnx: str | None = "ppocr-cls") -> Path:
    """DIR/<name>/model.toml with ``toml``, beside a link to a built-in model's file."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(toml)
    if onnx is not None:
        (folder / "model.onnx").symlink_to(locate(onnx))
    return folder


CLS = """description = "angle classifier"
backends = ["onnxruntime"]
max_batch = 16
[inputs.x]
min_shape = [1, 3, 48, 16]
[inputs.x.pad]
buckets = [[3, 48, 192], [3, 48, 320]]
value = 0.5
[warmup]
x = [[1, 3, 48, 192], [1, 3, 48, 320]]
"""


def test_a_repository_model_has_every_key_of_its_toml(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "cls", CLS)
    (model,) = load(tmp_path).models.values()
    config = model.config
    assert (config.name, config.path, config.source) == ("cls", str(folder / "model.onnx"), None)
    assert (config.description, config.backends, config.max_batch) == (
        "angle classifier",
        ("onnxruntime",),
        16,
    )
    assert config.inputs == {
        "x": InputConfig(
            min_shape=(1, 3, 48, 16),
            pad=PadRule(buckets=((3, 48, 192), (3, 48, 320)), value=0.5),
        )
    }
    assert config.warmup == {"x": ((1, 3, 48, 192), (1, 3, 48, 320))}
    assert model.toml == folder / "model.toml"


def test_a_model_names_its_file_or_a_wheels_file(tmp_path: Path) -> None:
    add_model(tmp_path, "a", 'path = "cls.onnx"\n', onnx=None)
    add_model(
        tmp_path,
        "b",
        '[source]\ndistribution = "rapidocr-onnxruntime"\nversion = "1.4.4"\n'
        'file = "ch_ppocr_mobile_v2.0_cls_infer.onnx"\n',
        onnx=None,
    )
    models = load(tmp_path).models
    assert models["a"].config.path == str(tmp_path / "a" / "cls.onnx")
    assert models["b"].config.path == ""
    assert models["b"].config.source == SourceConfig(
        "rapidocr-onnxruntime", "1.4.4", "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    )


def test_crops_read_as_their_axes(tmp_path: Path) -> None:
    add_model(
        tmp_path,
        "rec",
        '[outputs."softmax_11.tmp_0"]\n'
        'crop = [{ axis = 1, input = "x", input_axis = 3, scale = [1, 8] }]\n',
        onnx="ppocr-rec",
    )
    (model,) = load(tmp_path).models.values()
    (output,) = model.config.outputs.values()
    assert output == OutputConfig((CropConfig(1, "x", 3, (1, 8)),))
    assert output.crop[0].crop_axis() == CropAxis(1, "x", 3, 1, 8)


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        ("max_batch = 0\n", "model 'm': max_batch must be in 1..4096"),
        ("max_batch = 'big'\n", "max_batch: expected int, got str"),
        ("colour = 'red'\n", "colour: unknown setting"),
        ('name = "other"\n', "name: is 'other'; a repository's model is named by its folder"),
        ('backends = ["tensorflow"]\n', "backends must name each of onnxruntime, tensorrt"),
        ("[inputs.x.pad]\nmultiple_of = 32\n", "inputs.x.pad.multiple_of: expected a list"),
        ("[inputs.x]\npad = 1\n", "inputs.x.pad: expected a table"),
        ("[source]\ndistribution = 'w'\n", "source.version: missing (it has no default)"),
        (
            '[source]\ndistribution = "w"\nversion = "1"\nfile = "m.onnx"\nsha256 = "abc"\n',
            "source.sha256 must be 64 lowercase hex digits",
        ),
        ('path = "m.onnx"\n[source]\ndistribution = "w"\nversion = "1"\nfile = "f"\n', "give one"),
        ("max_batch = [\n", "is not valid TOML"),
    ],
)
def test_a_broken_model_toml_names_its_file_and_key(
    tmp_path: Path, toml: str, problem: str
) -> None:
    add_model(tmp_path, "m", toml)
    repository, problems = scan(tmp_path)
    assert repository.models == {}
    assert problems
    assert all(p.startswith(str(tmp_path / "m" / "model.toml") + ": ") for p in problems)
    assert any(problem in p for p in problems), problems


def test_every_problem_of_a_repository_is_listed_at_once(tmp_path: Path) -> None:
    add_model(tmp_path, "a", "max_batch = 'x'\nslots = 2\n")
    add_model(tmp_path, "good", "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as caught:
        load(tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"model repository {tmp_path}:"
    assert [line.strip() for line in lines[1:]] == [
        f"{tmp_path}/a/model.toml: max_batch: expected int, got str",
        f"{tmp_path}/a/model.toml: slots: unknown setting (known: " + lines[2].split("known: ")[1],
        f"{tmp_path}/empty: no model.toml (each folder of a repository is one model)",
    ]


def test_a_folder_that_is_no_repository_says_so(tmp_path: Path) -> None:
    assert scan(tmp_path / "nope")[1] == [
        f"{tmp_path}/nope: not a folder (a model repository is one)"
    ]
    assert scan(tmp_path)[1] == [f"{tmp_path}: no model folders (DIR/<name>/model.toml)"]


def test_the_built_in_models_are_a_repository_of_wheel_files() -> None:
    models = builtin().models
    assert list(models) == ["orientation", "ppocr-cls", "ppocr-det", "ppocr-rec"]
    assert all(m.config.source is not None for m in models.values())
    # ppocr-det pads frames to multiples of 32 instead of refusing them (protocol §8.1).
    det = models["ppocr-det"].config.inputs["x"]
    assert (det.multiple_of, det.pad) == ((), PadRule(multiple_of=(1, 32, 32)))


def test_the_built_in_models_are_package_data() -> None:
    """pyproject.toml's package-data takes every file of the built-in repository, so a
    plain (not editable) install has them too."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["carpool"]
    files = [p.relative_to(BUILTIN_ROOT.parent) for p in BUILTIN_ROOT.rglob("*") if p.is_file()]
    assert files
    assert all(any(fnmatch.fnmatch(str(f), g) for g in globs) for f in files), files


# --------------------------------------------------------------------------- workers


def _worker_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def test_a_worker_serves_every_model_of_its_repository_or_those_named(tmp_path: Path) -> None:
    add_model(tmp_path, "cls", CLS)
    add_model(tmp_path, "rec", "max_batch = 4\n", onnx="ppocr-rec")
    every = worker_config(_worker_args("--repository", str(tmp_path))).models
    assert [(m.name, m.max_batch) for m in every] == [("cls", 16), ("rec", 4)]
    named = worker_config(_worker_args("--repository", str(tmp_path), "--model", "rec"))
    assert [m.name for m in named.models] == ["rec"]
    # A name the repository lacks is what --model takes without one (a built-in model).
    mixed = worker_config(
        _worker_args("--repository", str(tmp_path), "--model", "rec", "--model", "orientation")
    )
    assert [(m.name, m.path) for m in mixed.models] == [
        ("rec", str(tmp_path / "rec" / "model.onnx")),
        ("orientation", ""),
    ]


def test_worker_toml_names_a_repository_and_lays_its_tables_over_its_models(
    tmp_path: Path,
) -> None:
    """repository = "DIR" in worker.toml; a [[models]] table naming one of its models
    keeps that model's keys, the table's own winning (inputs and outputs per name)."""
    repo = tmp_path / "models"
    add_model(repo, "cls", CLS)
    toml = tmp_path / "w.toml"
    toml.write_text(f'repository = "{repo}"\n')
    assert [m.name for m in worker_config(_worker_args("--config", str(toml))).models] == ["cls"]
    toml.write_text(
        f'repository = "{repo}"\n[[models]]\nname = "cls"\nmax_batch = 4\n'
        "[models.inputs.x]\nmax_shape = [-1, 3, 48, 640]\n"
        '[[models]]\nname = "s"\nengine = "synthetic"\n'
    )
    cls, synthetic = worker_config(_worker_args("--config", str(toml))).models
    assert (cls.max_batch, cls.description, cls.path) == (
        4,
        "angle classifier",
        str(repo / "cls" / "model.onnx"),
    )
    assert cls.inputs == {"x": InputConfig(max_shape=(-1, 3, 48, 640))}
    assert cls.warmup == {"x": ((1, 3, 48, 192), (1, 3, 48, 320))}
    assert synthetic.engine == "synthetic"


def test_a_models_tensorrt_table_and_folder_reach_its_config(tmp_path: Path) -> None:
    """[tensorrt] in model.toml, laid over key by key by worker.toml's [models.tensorrt];
    the model's folder (its plans/) set by the repository."""
    repo = tmp_path / "models"
    add_model(
        repo,
        "cls",
        CLS + '[tensorrt]\nprecision = "fp16"\nbatches = ["1:4:8"]\nmax_profiles = 10\n',
    )
    (model,) = load(repo).models.values()
    assert model.config.folder == str(repo / "cls")
    assert model.config.tensorrt == TensorRTConfig(
        precision="fp16", batches=("1:4:8",), max_profiles=10
    )
    toml = tmp_path / "w.toml"
    toml.write_text(
        f'repository = "{repo}"\n[[models]]\nname = "cls"\n[models.tensorrt]\nbuild = true\n'
    )
    (cls,) = worker_config(_worker_args("--config", str(toml))).models
    assert cls.tensorrt == TensorRTConfig(
        precision="fp16", batches=("1:4:8",), max_profiles=10, build=True
    )
    assert cls.folder == str(repo / "cls")


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('precision = "fp8"', "tensorrt.precision must be one of fp32, fp16, int8"),
        ('batches = ["8:4:1"]', "tensorrt: --batch '8:4:1': needs 1 <= MIN <= OPT <= MAX"),
        ('profiles = ["x=1x3"]', "tensorrt: --profile 'x=1x3': each input is NAME=MIN:OPT:MAX"),
        ("max_profiles = 0", "tensorrt: max_profiles and max_ratio must be >= 1"),
    ],
)
def test_a_bad_tensorrt_table_is_refused_naming_the_key(
    tmp_path: Path, table: str, says: str
) -> None:
    add_model(tmp_path, "cls", CLS + f"[tensorrt]\n{table}\n")
    with pytest.raises(ConfigError) as refused:
        load(tmp_path)
    assert says in str(refused.value)


def test_a_table_that_names_a_file_replaces_the_repositorys() -> None:
    base = {"name": "m", "source": {"file": "a"}, "inputs": {"x": {}, "y": {}}}
    assert merged(base, {"path": "/m.onnx", "inputs": {"y": {"pad": {}}}}) == {
        "name": "m",
        "path": "/m.onnx",
        "inputs": {"x": {}, "y": {"pad": {}}},
    }


def test_a_repository_model_served_with_a_backend_it_does_not_name_is_refused(
    tmp_path: Path,
) -> None:
    add_model(tmp_path, "cls", 'backends = ["tensorrt"]\n')
    (model,) = worker_config(_worker_args("--repository", str(tmp_path))).models
    with pytest.raises(ConfigError, match=r"'cls' may be served with tensorrt only .* not onnx"):
        engine_factory(model)


def test_a_repository_models_pads_and_crops_reach_the_spec_the_worker_announces(
    tmp_path: Path,
) -> None:
    add_model(
        tmp_path,
        "rec",
        "[inputs.x.pad]\nbuckets = [[3, 48, 160], [3, 48, 320]]\n"
        '[outputs."softmax_11.tmp_0"]\n'
        'crop = [{ axis = 1, input = "x", input_axis = 3, scale = [1, 8] }]\n'
        "[warmup]\nx = [[1, 3, 48, 160]]\n",
        onnx="ppocr-rec",
    )
    (model,) = worker_config(_worker_args("--repository", str(tmp_path))).models
    info = engine_factory(model)().info
    assert info.io.pads == (PadRule(buckets=((3, 48, 160), (3, 48, 320))),)
    assert info.io.crops == ((CropAxis(1, "x", 3, 1, 8),),)
    assert info.warmup == (((1, 3, 48, 160),),)
    wire = info.spec("rec").to_wire()
    assert wire["inputs"][0]["pad"] == {"buckets": [[3, 48, 160], [3, 48, 320]], "value": 0.0}
    assert wire["outputs"][0]["crop"] == [
        {"axis": 1, "input": "x", "input_axis": 3, "scale": [1, 8]}
    ]


def test_a_pad_rule_that_does_not_fit_the_file_stops_the_worker(tmp_path: Path) -> None:
    add_model(tmp_path, "cls", "[inputs.x.pad]\nmultiple_of = [32, 32]\n")
    (model,) = worker_config(_worker_args("--repository", str(tmp_path))).models
    with pytest.raises(ConfigError, match=r"inputs\.x\.pad\.multiple_of: has 2 entries"):
        engine_factory(model)()


def test_worker_toml_tables_take_the_same_keys(tmp_path: Path) -> None:
    """One schema: pad rules, crops, backends and warm-up shapes in [[models]] too."""
    toml = tmp_path / "w.toml"
    toml.write_text(
        '[[models]]\nname = "det"\npath = "' + str(locate("ppocr-det")) + '"\n'
        'backends = ["onnxruntime"]\n'
        "[models.inputs.x.pad]\nmultiple_of = [1, 32, 32]\n"
        '[models.outputs."sigmoid_0.tmp_0"]\n'
        'crop = [{ axis = 2, input = "x", input_axis = 2 }, { axis = 3, input = "x", '
        "input_axis = 3 }]\n"
        "[models.warmup]\nx = [[1, 3, 32, 32]]\n"
    )
    (model,) = worker_config(_worker_args("--config", str(toml))).models
    info = engine_factory(model)().info
    assert info.io.pads == (PadRule(multiple_of=(1, 32, 32)),)
    assert info.io.crops == ((CropAxis(2, "x", 2), CropAxis(3, "x", 3)),)


def test_an_unknown_repository_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a folder"):
        worker_config(_worker_args("--repository", str(tmp_path / "nope")))
