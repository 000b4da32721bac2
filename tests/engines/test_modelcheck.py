"""worker/modelcheck.py: a repository against its real ONNX files — their inputs and
outputs (read with ONNX Runtime), the wheel a [source] names, its sha256."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.worker.modelcheck import check, describe, model_problems
from carpool.worker.repository import BUILTIN_ROOT, load
from tests.unit.worker.test_repository import add_model

SOURCE = (
    '[source]\ndistribution = "rapidocr-onnxruntime"\nversion = "{version}"\n'
    'file = "ch_ppocr_mobile_v2.0_cls_infer.onnx"\nsha256 = "{sha256}"\n'
)
CLS_SHA256 = "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"


def test_the_built_in_repository_validates_clean() -> None:
    repository, problems = check(BUILTIN_ROOT)
    assert problems == []
    assert len(repository.models) == 4


def test_a_repository_that_fits_its_files_has_no_problems(tmp_path: Path) -> None:
    add_model(
        tmp_path,
        "cls",
        'backends = ["onnxruntime", "tensorrt"]\n[inputs.x.pad]\nbuckets = [[3, 48, 192]]\n'
        "[warmup]\nx = [[2, 3, 48, 192]]\n",
    )
    add_model(
        tmp_path,
        "rec",
        '[outputs."softmax_11.tmp_0"]\n'
        'crop = [{ axis = 1, input = "x", input_axis = 3, scale = [1, 8] }]\n',
        onnx="ppocr-rec",
    )
    add_model(tmp_path, "wheel", SOURCE.format(version="1.4.4", sha256=CLS_SHA256), onnx=None)
    add_model(tmp_path, "s", 'engine = "synthetic"\nitem_shape = [-1]\n[warmup]\nx = [[1, 5]]\n')
    repository, problems = check(tmp_path)
    assert problems == []
    assert list(repository.models) == ["cls", "rec", "s", "wheel"]


@pytest.mark.parametrize(
    ("toml", "onnx", "problem"),
    [
        (
            "[inputs.x.pad]\nmultiple_of = [32, 32]\n",
            "ppocr-det",
            "inputs.x.pad.multiple_of: has 2 entries, the input has 3 dims after the batch dim",
        ),
        (
            '[outputs.y]\ncrop = [{ axis = 1, input = "x", input_axis = 3 }]\n',
            "ppocr-rec",
            "outputs.y: no output 'y'; the model's outputs are ['softmax_11.tmp_0']",
        ),
        (
            '[outputs."softmax_11.tmp_0"]\ncrop = [{ axis = 2, input = "x", input_axis = 3 }]\n',
            "ppocr-rec",
            "outputs.softmax_11.tmp_0.crop[0].axis: output axis 2 is fixed at 6625, not dynamic",
        ),
        (
            "[warmup]\nx = [[1, 3, 224]]\n",
            "orientation",
            "warmup.x[0]: [1, 3, 224] has 3 dims, the input has 4",
        ),
        (
            'engine = "onnxruntime"\nbackends = ["tensorrt"]\n',
            "ppocr-cls",
            "engine: onnxruntime is not one of its backends ['tensorrt']",
        ),
        ("", None, "path: no ONNX file {folder}/model.onnx"),
        (
            SOURCE.format(version="1.4.4", sha256="0" * 64),
            None,
            "source.sha256: {onnx} has sha256 " + CLS_SHA256,
        ),
        (
            SOURCE.format(version="1.4.3", sha256=CLS_SHA256),
            None,
            "source.version: 1.4.3 is pinned, 1.4.4 is installed: "
            "pip install --no-deps rapidocr-onnxruntime==1.4.3",
        ),
        (
            '[source]\ndistribution = "no-such-wheel"\nversion = "1"\nfile = "m.onnx"\n',
            None,
            "source: no-such-wheel is not installed: pip install --no-deps no-such-wheel==1",
        ),
        (
            '[source]\ndistribution = "rapidocr-onnxruntime"\nversion = "1.4.4"\n'
            'file = "nope.onnx"\n',
            None,
            "source.file: rapidocr-onnxruntime has no nope.onnx",
        ),
    ],
)
def test_each_problem_names_the_file_the_key_and_the_rule(
    tmp_path: Path, toml: str, onnx: str | None, problem: str
) -> None:
    folder = add_model(tmp_path, "m", toml, onnx=onnx)
    _, problems = check(tmp_path)
    expected = problem.format(folder=folder, onnx=_cls_file())
    (found,) = problems
    assert found.startswith(f"{folder}/model.toml: {expected}"), found


def _cls_file() -> str:
    from carpool.worker.models import locate

    return str(locate("ppocr-cls"))


@pytest.mark.parametrize("name", ["orientation", "ppocr-cls", "ppocr-det", "ppocr-rec"])
def test_the_onnx_package_reads_what_onnx_runtime_reads(name: str) -> None:
    """Where onnxruntime is missing (a TensorRT host), check reads files with onnx."""
    from carpool.worker.engines.ort import read_io
    from carpool.worker.modelcheck import read_with_onnx
    from carpool.worker.models import locate

    assert read_with_onnx(locate(name)) == read_io(locate(name))


def test_a_file_onnx_runtime_cannot_load_is_a_problem_of_its_path(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m", "", onnx=None)
    (folder / "model.onnx").write_bytes(b"not a model")
    (problem,) = check(tmp_path)[1]
    assert problem.startswith(f"{folder}/model.toml: path: cannot load ONNX model "), problem


def test_list_shows_dynamic_dims_buckets_and_crops(tmp_path: Path) -> None:
    add_model(
        tmp_path,
        "rec",
        'description = "recogniser"\nmax_batch = 4\n[inputs.x.pad]\nbuckets = [[3, 48, 320]]\n'
        '[outputs."softmax_11.tmp_0"]\n'
        'crop = [{ axis = 1, input = "x", input_axis = 3, scale = [1, 8] }]\n',
        onnx="ppocr-rec",
    )
    (model,) = load(tmp_path).models.values()
    lines, problems = describe(model)
    assert problems == []
    assert lines[:3] == ["rec: recogniser", "  backends   any", "  max_batch  4"]
    assert lines[4] == (
        "  input      x float32 [B, 3, ?, ?]  buckets: item shapes that fit one of the "
        "buckets [3, 48, 320] (at most [3, 48, 320])"
    )
    assert lines[5] == "  output     softmax_11.tmp_0 float32 [B, ?, 6625]  crop axis 1 = x[3]×1/8"


def test_the_docs_examples_check_clean_against_the_real_files(tmp_path: Path) -> None:
    """docs/models.md's detector and recognizer configs, beside the files they name."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    blocks = re.findall(r"```toml\n# models/([\w-]+)/model.toml[^\n]*\n(.*?)```", text, re.S)
    assert [name for name, _ in blocks] == ["ppocr-det", "ppocr-rec"]
    for name, toml in blocks:
        add_model(tmp_path, name, toml, onnx=name)
    repository, problems = check(tmp_path)
    assert problems == []
    assert repository.models["ppocr-rec"].config.inputs["x"].pad is not None


def test_the_docs_name_every_key_of_the_schema() -> None:
    import dataclasses

    from carpool.worker.config import ModelConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    for field in dataclasses.fields(ModelConfig):
        assert f"`{field.name}`" in text or f"[{field.name}" in text, field.name


def test_without_onnxruntime_check_reads_the_files_with_onnx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host with onnx but no onnxruntime (a TensorRT host) still checks its files:
    ``import onnxruntime`` fails inside read_io, and check falls back to onnx."""
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    repository, problems = check(BUILTIN_ROOT)
    assert problems == []
    for model in repository.models.values():
        io, _ = model_problems(model)
        assert io.inputs, model.config.name
        assert io.outputs, model.config.name
