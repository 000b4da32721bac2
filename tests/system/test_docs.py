"""README.md and docs/ say what the code does: their links stay inside the repository, the
documented defaults, snippets and benchmark flags are the code's, error messages point to
sections that exist, every figure shown exists, and every benchmark table names the commit
it measured."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    """A clone of the repository has nothing above its root for a doc to point at."""
    for doc in DOCS:
        assert "../" not in doc.read_text(encoding="utf-8"), doc.name


def test_the_fixed_batch_dim_error_points_to_a_doc_section() -> None:
    """The fixed-dim-0 refusal says "see docs/<doc>.md: <heading>", and that doc has that
    heading."""
    source = Path(ort.__file__).read_text(encoding="utf-8")
    ((doc, pointer),) = re.findall(r"see (docs/\w+\.md): ([^)\"]+)", source)
    headings = [
        line.lstrip("#").strip().lower()
        for line in (ROOT / doc).read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]
    assert pointer.strip().lower() in headings


def test_the_batching_configuration_shown_is_the_default() -> None:
    """The [batching] block docs/batching.md shows is BatchingConfig's defaults, key for key."""
    text = (ROOT / "docs" / "batching.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(\[batching\].*?)```", text, re.S)
    shown = tomllib.loads(block)["batching"]
    defaults = dataclasses.asdict(BatchingConfig())
    assert shown == defaults


def test_the_input_limits_example_is_a_worker_config_that_says_what_it_shows() -> None:
    """docs/models.md's "Limits on dynamic dims" example."""
    from carpool.common.config import from_mapping
    from carpool.common.shape_rules import ShapeRule
    from carpool.worker.config import WorkerConfig

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(\[\[models\]\].*?)```", text, re.S)
    (model,) = from_mapping(WorkerConfig, tomllib.loads(block)).models
    rule = model.inputs["x"].rule()
    assert rule == ShapeRule(max_shape=(-1, 3, 1536, 1536), multiple_of=(1, 1, 32, 32))
    (claim,) = re.findall(r'\("(dim 2 is 720, .*?\))"\)', text, re.S)
    assert rule.violation((1, 3, 720, 1280)) == " ".join(claim.split())


@contextlib.contextmanager
def _orientation_fleet(item_shape: tuple[int, ...]) -> Iterator[str]:
    """A broker and one worker whose synthetic engine serves "orientation" (y = 2x + 1);
    yields the broker's frontend endpoint once the worker has joined."""
    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer
    from carpool.client import Client
    from carpool.common.testing import ServerThread
    from carpool.worker.engines.synthetic import SyntheticEngine
    from carpool.worker.server import WorkerServer
    from tests.conftest import loopback_config, wait_for_workers

    config: BrokerConfig = loopback_config()
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(ServerThread(BrokerServer(config)))
        engine = lambda: SyntheticEngine(item_shape=item_shape)  # noqa: E731
        stack.enter_context(
            ServerThread(WorkerServer(broker.backend_endpoint, {"orientation": engine}))
        )
        with Client(broker.frontend_endpoint) as probe:
            wait_for_workers(probe, 1)
        yield broker.frontend_endpoint


def test_the_readmes_sdk_example_runs_against_a_fleet() -> None:
    """The README's ten-line SDK example, run as written on a synthetic model of the
    orientation model's input shape."""
    import numpy as np

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## The SDK in ten lines")
    (snippet,) = re.findall(r"```python\n(.*?)```", text[start:], re.S)[:1]
    assert "with Client(" in snippet
    assert len(snippet.strip().splitlines()) <= 10
    with _orientation_fleet((3, 224, 224)) as endpoint:
        scope: dict[str, Any] = {}
        exec(snippet.replace('"tcp://127.0.0.1:5555"', repr(endpoint)), scope)
    images, outputs, results = scope["images"], scope["outputs"], scope["results"]
    np.testing.assert_allclose(outputs["y"], 2 * images[0] + 1, rtol=1e-6)
    assert len(results) == len(images) == 8
    for image, result in zip(images, results, strict=True):
        np.testing.assert_allclose(result.outputs["y"], 2 * image + 1, rtol=1e-6)
        assert result.batch_size >= 1


def test_the_client_docs_examples_run_against_a_fleet() -> None:
    """docs/client.md's sync and async snippets, run as written on a synthetic model."""
    import asyncio

    import numpy as np

    text = (ROOT / "docs" / "client.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)[:2]
    assert "with Client(" in blocks[0]
    assert "async with AsyncClient(" in blocks[1]
    with _orientation_fleet((3,)) as endpoint:
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


def test_the_batch_dim_snippet_makes_a_fixed_batch_model_servable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that records intermediate shapes with batch 1 (torch.onnx.export, onnx's shape
    inference and onnxsim write them) makes ONNX Runtime infer a fixed dim 0 for the output
    even with inputs and outputs relabelled; the snippet drops those shapes too, and the
    worker serves the file it writes."""
    onnx = pytest.importorskip("onnx")
    import numpy as np

    from carpool.common.errors import ConfigError
    from carpool.worker.warmup import warm_up

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
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"```python\n(import onnx\n.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/models.md", "exec"), {})
    engine = ort.OnnxRuntimeEngine(tmp_path / "my-dynamic.onnx")
    warm_up(engine, "my")
    x = np.array([[1, -2, 3], [-4, 5, -6]], np.float32)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], -np.maximum(x, 0))


BENCHMARKS = ROOT / "docs" / "benchmarks.md"
BENCH = ROOT / "bench"


def test_every_figure_shown_exists_and_every_figure_is_shown() -> None:
    shown: set[Path] = set()
    for doc in DOCS:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", doc.read_text(encoding="utf-8")):
            path = (doc.parent / target).resolve()
            assert path.is_file(), f"{doc.name} shows {target}, which does not exist"
            shown.add(path)
    for image in sorted((ROOT / "docs" / "img").iterdir()):
        assert image.resolve() in shown, f"no doc shows {image.name}"


# The two words the docs and sources keep out, built from parts so that this file does
# not hold them: a plain grep for them finds only the uses allowed below.
_S_WORD = "sess" + "ion"
_R_WORD = "rev" + "iew"
#: The uses of the first allowed: ONNX Runtime's inference ones (InferenceSession,
#: SessionOptions, the engine's ``_session`` attribute) and network ones.
_ALLOWED = re.compile(
    rf"inference ?{_S_WORD}|{_S_WORD}options|\b_{_S_WORD}\b|network {_S_WORD}", re.I
)
SOURCES = sorted(p for d in ("src", "tests", "bench") for p in (ROOT / d).rglob("*.py"))


def _diary_lines(path: Path) -> list[str]:
    """The lines of ``path`` that use either word outside the allowed uses, line by line
    as grep reads them."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        rest = _ALLOWED.sub("", line).lower()
        if _S_WORD in rest or _R_WORD in rest:
            found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_the_docs_are_documentation_not_a_diary() -> None:
    """The docs name ONNX Runtime's inference sessions and network ones, and no other
    kind; nor do they retell how the code came to be: history lives in git."""
    assert [line for doc in DOCS for line in _diary_lines(doc)] == []


def test_the_sources_and_tests_are_documentation_not_a_diary() -> None:
    """The same holds of every .py file under src/, tests/ and bench/: code, comments,
    docstrings and test names."""
    assert len(SOURCES) > 100
    assert [line for path in SOURCES for line in _diary_lines(path)] == []


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_each_benchmark_result_names_the_commit_it_measured() -> None:
    """Every results table of docs/benchmarks.md says which commit's code it measured, and
    each summary row names the commits of its figures."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    sections = _sections(text)
    results = [name for name, body in sections.items() if "### Results" in body]
    assert len(results) >= 6, sorted(sections)
    commit = re.compile(r"commit\s+[0-9a-f]{7,40}\b", re.I)
    for name in results:
        blocks = sections[name].split("### Results", 1)[1].split("\n\n")
        tables = [i for i, block in enumerate(blocks) if block.lstrip().startswith("|")]
        assert tables, f"{name}: no results table"
        for i in tables:
            caption = blocks[i - 1] + blocks[i].lstrip().split("\n", 1)[0]
            assert commit.search(caption), f"{name}: a table names no commit: {blocks[i][:60]}"
    rows = [line for line in sections["Summary"].splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 8
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[1]
        assert re.fullmatch(r"\s*[0-9a-f]{7,40}(, [0-9a-f]{7,40})*\s*", cell), row


def _named_commits() -> set[str]:
    """The abbreviated hashes the docs name: 7 hex digits, both letters and digits."""
    words = {w for doc in DOCS for w in re.findall(r"\b[0-9a-f]{7}\b", doc.read_text("utf-8"))}
    return {w for w in words if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)}


def test_the_commits_the_benchmarks_name_exist() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(
        [git, "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("a shallow or unreadable clone does not hold the history")
    commits = _named_commits()
    assert commits
    for commit in sorted(commits):
        found = subprocess.run(
            [git, "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
            capture_output=True,
            check=False,
        )
        assert found.returncode == 0, f"the docs name {commit}, not a commit here"


def test_the_benchmark_scripts_and_flags_documented_exist() -> None:
    """Each bench/*.py the docs name exists; each benchmark script has its place in
    docs/benchmarks.md; each flag in its rerun table is one the script (or the parser all
    of them share, bench/common.py) defines."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    for doc in DOCS:
        for name in re.findall(r"bench/(\w+\.py)", doc.read_text(encoding="utf-8")):
            assert (BENCH / name).is_file(), f"{doc.name} names bench/{name}"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    (suite,) = re.findall(r"for s in ([\w ]+); do", makefile)
    for script in [*suite.split(), "hot_path"]:
        assert f"bench/{script}.py" in text, script
    shared = (BENCH / "common.py").read_text(encoding="utf-8")
    table = text.split("| script | flags |", 1)[1].split("\n\n", 1)[0]
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        scripts = re.findall(r"`(\w+\.py)`", first)
        source = shared if "every script" in first else (BENCH / scripts[0]).read_text("utf-8")
        for flag in re.findall(r"`(--[a-z][a-z-]*)", row):
            assert f'"{flag}"' in source, f"{first.strip()}: {flag}"


def test_the_modules_and_paths_the_docs_name_exist() -> None:
    """Each dotted carpool name the docs give imports (a module, or an attribute of one),
    and each src/carpool path (with {a,b} alternatives) is a file or folder."""
    import importlib

    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for name in set(re.findall(r"\bcarpool(?:\.[a-z_]+)+", text)):
            module, attribute = name, ""
            while True:
                try:
                    found: object = importlib.import_module(module)
                    break
                except ModuleNotFoundError:
                    module, _, tail = module.rpartition(".")
                    attribute = f"{tail}.{attribute}" if attribute else tail
            for part in filter(None, attribute.split(".")):
                assert hasattr(found, part), f"{doc.name} names {name}"
                found = getattr(found, part)
        for path in set(re.findall(r"src/carpool/[\w/{},.]*\w/?", text)):
            head, _, rest = path.partition("{")
            choices, _, tail = rest.partition("}")
            for choice in choices.split(",") if rest else [""]:
                assert (ROOT / f"{head}{choice}{tail}").exists(), f"{doc.name} names {path}"
