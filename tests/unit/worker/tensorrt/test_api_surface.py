"""The TensorRT API surface: every tensorrt attribute the adapters use (read from their
source, src/carpool/worker/engines/trt.py) is a member of the real binding modules of
TensorRT 10.3 (JetPack 6) and 11.4, as tools/trt_members.py recorded them in
tests/data/tensorrt/; one only guarded by ``hasattr`` may be missing from one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .surface import UNKNOWN, Use, merged, uses

ROOT = Path(__file__).resolve().parents[4]
DATA = ROOT / "tests" / "data" / "tensorrt"
RELEASES = ("10.3.0", "11.4.0.106")
SRC = ROOT / "src" / "carpool"
#: The modules that import tensorrt (the adapters): found in the source, not listed by hand.
ADAPTERS = sorted(
    path
    for path in SRC.rglob("*.py")
    if re.search(r"^\s*(import tensorrt|from tensorrt)\b", path.read_text(), re.MULTILINE)
)


def _listing(release: str) -> dict[str, dict[str, str | None]]:
    data = json.loads((DATA / f"tensorrt-{release}.json").read_text())
    assert data["version"] == release
    members: dict[str, dict[str, str | None]] = data["members"]
    # The methods an application class overrides (IOutputAllocator's) are no attributes of
    # the pybind11 base: the lists name them apart, and a subclass may define them.
    for cls, names in data["callbacks"].items():
        members[cls].update(dict.fromkeys(names))
    return members


LISTS = {release: _listing(release) for release in RELEASES}
ALL = merged(*LISTS.values())


def problems(found: list[Use], where: str) -> list[str]:
    """What of ``found`` is not in the releases' member lists."""
    out = []
    for use in found:
        at = f"{where}:{use.line}: tensorrt"
        if use.cls == UNKNOWN:
            out.append(
                f"{at} attribute {use.attr!r} is used on a value whose class cannot be told "
                "(assign it from a call whose class the member lists give)"
            )
            continue
        missing = [r for r in RELEASES if use.attr not in LISTS[r].get(use.cls, {})]
        if missing and (not use.guarded or len(missing) == len(RELEASES)):
            lists = ", ".join(f"tests/data/tensorrt/tensorrt-{r}.json" for r in missing)
            out.append(
                f"{at} {use.cls}.{use.attr} is not in TensorRT {', '.join(missing)} ({lists})"
                + ("" if use.guarded else "; guard it with hasattr or keep to both releases")
            )
    return out


def test_only_the_adapters_import_tensorrt() -> None:
    engines = SRC / "worker" / "engines"
    assert [engines / "trt.py"] == ADAPTERS


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.name)
def test_every_tensorrt_attribute_an_adapter_uses_is_in_10_3_and_11_4(path: Path) -> None:
    found = uses(path.read_text(), ALL)
    assert found, f"{path}: no tensorrt use found (does it import tensorrt?)"
    assert problems(found, str(path.relative_to(ROOT))) == []


def test_the_walk_reaches_the_classes_the_adapter_runs_and_builds_with() -> None:
    """The walk follows the adapter's values to their classes (not only trt.X names)."""
    found = uses((ROOT / "src/carpool/worker/engines/trt.py").read_text(), ALL)
    assert {u.cls for u in found} >= {
        "<module>",
        "Runtime",
        "ICudaEngine",
        "IExecutionContext",
        "IOutputAllocator",
        "Builder",
        "IBuilderConfig",
        "OnnxParser",
        "IOptimizationProfile",
        "ITimingCache",
        "BuilderFlag",
        "IProgressMonitor",
    }


# A made-up adapter: each use below breaks the rule in one way.
BROKEN = """
class Adapter:
    def __init__(self):
        import tensorrt as trt
        self._builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
        self._config = self._builder.create_builder_config()

    def bad(self):
        import tensorrt as trt
        self._builder.create_netwrok(0)                    # made up
        self._config.set_flag(trt.BuilderFlag.FP16)       # gone in 11, unguarded
        fast = self._builder.platform_has_fast_fp16       # gone in 11, unguarded
        if hasattr(trt.BuilderFlag, "FP16"):
            self._config.set_flag(trt.BuilderFlag.FP16)   # guarded: fine
        if hasattr(trt, "NoSuchThing"):
            trt.NoSuchThing                                 # guarded, but in neither
        self._config.get_memory_pool_limit(0).real         # an int: no class to check against
"""


def test_the_check_fails_a_made_up_attribute_and_ones_11_removed() -> None:
    found = problems(uses(BROKEN, ALL), "broken.py")
    assert found == [
        "broken.py:10: tensorrt Builder.create_netwrok is not in TensorRT 10.3.0, 11.4.0.106 "
        "(tests/data/tensorrt/tensorrt-10.3.0.json, tests/data/tensorrt/tensorrt-11.4.0.106.json)"
        "; guard it with hasattr or keep to both releases",
        "broken.py:11: tensorrt BuilderFlag.FP16 is not in TensorRT 11.4.0.106 "
        "(tests/data/tensorrt/tensorrt-11.4.0.106.json); guard it with hasattr or keep to both "
        "releases",
        "broken.py:12: tensorrt Builder.platform_has_fast_fp16 is not in TensorRT 11.4.0.106 "
        "(tests/data/tensorrt/tensorrt-11.4.0.106.json); guard it with hasattr or keep to both "
        "releases",
        "broken.py:16: tensorrt <module>.NoSuchThing is not in TensorRT 10.3.0, 11.4.0.106 "
        "(tests/data/tensorrt/tensorrt-10.3.0.json, tests/data/tensorrt/tensorrt-11.4.0.106.json)",
        "broken.py:17: tensorrt attribute 'real' is used on a value whose class cannot be told "
        "(assign it from a call whose class the member lists give)",
    ]


def test_the_member_lists_hold_what_the_research_recorded() -> None:
    """A cross-check of the recorded lists against docs/ facts about the releases."""
    ten, eleven = LISTS["10.3.0"], LISTS["11.4.0.106"]
    assert "FP16" in ten["BuilderFlag"]
    assert "FP16" not in eleven["BuilderFlag"]
    assert "EXPLICIT_BATCH" in ten["NetworkDefinitionCreationFlag"]
    assert "EXPLICIT_BATCH" not in eleven["NetworkDefinitionCreationFlag"]
    assert "IInt8EntropyCalibrator2" in ten
    assert "IInt8EntropyCalibrator2" not in eleven
    assert ten["Builder"]["create_builder_config"] == "IBuilderConfig"


NESTED = """
import tensorrt as trt

def run(path):
    logger = trt.Logger(trt.Logger.WARNING)
    with open(path) as f, trt.Runtimee(logger) as runtime:
        pass
    try:
        trt.Builder(logger).no_such_method()
    except RuntimeError:
        trt.Logger.LOUD

class Context:
    def __init__(self, trt_context):
        self._context = trt_context

    def run(self, stream):
        return self._context.execute_async_v4(stream)

def make(engine):
    made, tensors = engine.create_execution_context(), engine.num_io_tensor
    return Context(made)

def load(data):
    return make(trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(data))

class Allocator(trt.IOutputAllocator):
    def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
        return 0

    def notify_shapes(self, tensor_name, shape):  # (notify_shape)
        pass

    def _helper(self):
        pass
"""


def test_the_check_reaches_with_try_except_overrides_and_arguments() -> None:
    found = [p.split(" is not in")[0] for p in problems(uses(NESTED, ALL), "nested.py")]
    assert found == [
        "nested.py:6: tensorrt <module>.Runtimee",
        "nested.py:9: tensorrt Builder.no_such_method",
        "nested.py:11: tensorrt Logger.LOUD",
        "nested.py:18: tensorrt IExecutionContext.execute_async_v4",
        "nested.py:21: tensorrt ICudaEngine.num_io_tensor",
        "nested.py:31: tensorrt IOutputAllocator.notify_shapes",
    ]
