"""README.md and docs/ say what the code does: their links stay inside the repository, the
documented defaults are the code's, and error messages point to sections that exist."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from carpool.broker.config import BatchingConfig
from carpool.worker.engines import ort

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_point_at_nothing_outside_the_repository() -> None:
    """README linked ../shared/STYLE.md, which a clone of the repository does not have."""
    for doc in DOCS:
        assert "../" not in doc.read_text(encoding="utf-8"), doc.name


def test_the_fixed_batch_dim_error_points_to_a_readme_section() -> None:
    """The error said "see docs: make the batch dim dynamic" and no doc had such a part."""
    source = Path(ort.__file__).read_text(encoding="utf-8")
    (pointer,) = re.findall(r"see docs: ([^)\"]+)", source)
    headings = [
        line.lstrip("#").strip().lower()
        for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]
    assert pointer.strip().lower() in headings


def test_the_batching_configuration_shown_is_the_default() -> None:
    """docs/batching.md showed max_batch = 64 where the default is 8."""
    text = (ROOT / "docs" / "batching.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(\[batching\].*?)```", text, re.S)
    shown = tomllib.loads(block)["batching"]
    defaults = dataclasses.asdict(BatchingConfig())
    assert shown == defaults


def test_the_readmes_input_limits_example_is_a_worker_config_that_says_what_it_shows() -> None:
    from carpool.common.config import from_mapping
    from carpool.common.shape_rules import ShapeRule
    from carpool.worker.config import WorkerConfig

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(\[\[models\]\].*?)```", text, re.S)
    (model,) = from_mapping(WorkerConfig, tomllib.loads(block)).models
    rule = model.inputs["x"]
    assert rule == ShapeRule(max_shape=(-1, 3, 1536, 1536), multiple_of=(1, 1, 32, 32))
    (claim,) = re.findall(r'\("(dim 2 is 720, .*?\))"\)', text, re.S)
    assert rule.violation((1, 3, 720, 1280)) == " ".join(claim.split())


def test_the_readmes_client_examples_run_against_a_fleet() -> None:
    """The README's sync and async snippets, run as written on a synthetic model."""
    import asyncio
    import contextlib

    import numpy as np

    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer
    from carpool.common.testing import ServerThread
    from carpool.worker.engines.synthetic import SyntheticEngine
    from carpool.worker.server import WorkerServer
    from tests.conftest import loopback_config, wait_for_workers

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Client SDK")
    blocks = re.findall(r"```python\n(.*?)```", text[start:], re.S)[:2]
    assert "with Client(" in blocks[0]
    assert "async with AsyncClient(" in blocks[1]
    config: BrokerConfig = loopback_config()
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(ServerThread(BrokerServer(config)))
        engine = lambda: SyntheticEngine(item_shape=(3,))  # noqa: E731
        stack.enter_context(
            ServerThread(WorkerServer(broker.backend_endpoint, {"orientation": engine}))
        )
        from carpool.client import Client

        with Client(broker.frontend_endpoint) as probe:
            wait_for_workers(probe, 1)
        endpoint = broker.frontend_endpoint
        image = np.ones((1, 3), np.float32)
        images = [np.full((1, 3), i, np.float32) for i in range(4)]
        sync = blocks[0].replace('"tcp://127.0.0.1:5555"', repr(endpoint))
        scope: dict[str, object] = {"image": image, "images": images}
        exec(sync, scope)
        assert [r.outputs["y"][0, 0] for r in scope["results"]] == [1, 3, 5, 7]  # type: ignore[attr-defined]
        body = blocks[1].replace('"tcp://127.0.0.1:5555"', repr(endpoint))
        body = "async def main():\n" + "".join(f"    {line}\n" for line in body.splitlines())
        body += "    return outputs, results\n"
        scope = {"image": image, "images": images, "asyncio": asyncio}
        exec(body, scope)
        outputs, results = asyncio.run(scope["main"]())  # type: ignore[operator]
        assert outputs["y"].tolist() == [[3.0, 3.0, 3.0]]
        assert [r.outputs["y"][0, 0] for r in results] == [1, 3, 5, 7]


def test_the_readmes_batch_dim_snippet_makes_a_fixed_batch_model_servable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippet relabelled inputs and outputs only: a file that records intermediate
    shapes (torch.onnx.export, onnx's shape inference and onnxsim write them) kept batch 1
    there, ONNX Runtime inferred a fixed dim 0 for the output from them, and the worker
    refused the relabelled file with the same message pointing back to the snippet."""
    onnx = pytest.importorskip("onnx")
    import numpy as np

    from carpool.common.errors import ConfigError
    from carpool.worker.run import warm_up

    helper = onnx.helper
    f32 = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", f32, [1, 3])],
        [helper.make_tensor_value_info("y", f32, [1, 3])],
        value_info=[helper.make_tensor_value_info("h", f32, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "my.onnx"))
    with pytest.raises(ConfigError, match="fixed dim 0"):
        ort.OnnxRuntimeEngine(tmp_path / "my.onnx")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"```python\n(import onnx\n.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {})
    engine = ort.OnnxRuntimeEngine(tmp_path / "my-dynamic.onnx")
    warm_up(engine, "my")
    x = np.array([[1, -2, 3], [-4, 5, -6]], np.float32)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], -np.maximum(x, 0))
