"""worker/tensorrt/build.py against a recording fake of the builder adapter: the calls of
one build in order (one optimization profile per profile, precision flags per TensorRT
release, the timing cache loaded before and saved after), the plan cached and found
again, and the refusals (parse errors, no plan, a worker that may not build)."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.tensorrt import cache
from carpool.worker.tensorrt.build import BuildError, BuildRequest, ensure, prepare
from carpool.worker.tensorrt.cache import Device, Hit
from carpool.worker.tensorrt.precision import OnnxPrecision
from carpool.worker.tensorrt.profiles import InputRange, Limits, Profile
from carpool.worker.tensorrt.progress import PlainListener
from carpool.worker.tensorrt.versions import TrtVersion

from .onnx_files import image_model

H200 = Device("NVIDIA H200", (9, 0))
PROFILES = tuple(
    Profile((InputRange("x", (1, 3, s, s), (4, 3, s, s), (8, 3, s, s)),)) for s in (32, 64)
)


class RecordingBuilder:
    """The adapter's methods, each recorded; what TensorRT would answer is set up front."""

    def __init__(
        self,
        version: str = "10.3.0",
        *,
        plan: bytes | None = b"PLAN",
        parse_errors: Sequence[str] = (),
        accepts: Callable[[bytes], bool] = lambda data: True,
        profile_index: Callable[[int], int] = lambda k: k,
        profile_error: str | None = None,
    ) -> None:
        self.version = version
        self.calls: list[tuple[object, ...]] = []
        self._plan = plan
        self._parse_errors = list(parse_errors)
        self._accepts = accepts
        self._profile_index = profile_index
        self._profile_error = profile_error  # what set_shape raises (RuntimeError)
        self._profiles = 0
        self._cache = b""

    def create_network(self, strongly_typed: bool) -> None:
        self.calls.append(("create_network", strongly_typed))

    def parse_onnx(self, path: str) -> list[str]:
        self.calls.append(("parse_onnx", path))
        return self._parse_errors

    def create_config(self, workspace_bytes: int | None) -> None:
        self.calls.append(("create_config", workspace_bytes))

    def set_precision_flag(self, name: str) -> None:
        self.calls.append(("set_precision_flag", name))

    def add_profile(self, shapes) -> int:
        self.calls.append(("add_profile", tuple(shapes)))
        if self._profile_error is not None:
            raise RuntimeError(self._profile_error)
        self._profiles += 1
        return self._profile_index(self._profiles - 1)

    def set_timing_cache(self, data: bytes) -> bool:
        self.calls.append(("set_timing_cache", data))
        ok = self._accepts(data)
        if ok:
            self._cache = data
        return ok

    def timing_cache(self) -> bytes:
        self.calls.append(("timing_cache",))
        return self._cache + b"+timings"

    def set_listener(self, listener) -> None:
        self.calls.append(("set_listener",))
        listener.phase_start("Building engine", None, 1)
        listener.phase_finish("Building engine")

    def build(self) -> bytes | None:
        self.calls.append(("build",))
        return self._plan

    def names(self) -> list[object]:
        return [c[0] for c in self.calls]


@pytest.fixture
def request_for(tmp_path: Path) -> Callable[..., BuildRequest]:
    (tmp_path / "m").mkdir()
    onnx = image_model(tmp_path / "m" / "model.onnx")

    def make(**kwargs) -> BuildRequest:
        fields = {
            "model": "m",
            "onnx": onnx,
            "folder": tmp_path / "m",
            "repository": tmp_path,
            "profiles": PROFILES,
            "onnx_precision": OnnxPrecision(qdq=False, fp16=False),
            "precision": "fp16",
            "workspace_bytes": 1 << 30,
        }
        return BuildRequest(**{**fields, **kwargs})

    return make


def _ensure(request: BuildRequest, builder: RecordingBuilder, **kwargs):
    prepared = prepare(request, TrtVersion.parse(builder.version), H200)
    made: list[RecordingBuilder] = []

    def new_builder() -> RecordingBuilder:
        made.append(builder)
        return builder

    outcome = ensure(request, prepared, new_builder, PlainListener(io.StringIO()), **kwargs)
    return outcome, made


def test_a_tensorrt_10_build_calls_the_adapter_in_order(request_for) -> None:
    builder = RecordingBuilder("10.3.0")
    request = request_for()
    outcome, made = _ensure(request, builder)
    assert made == [builder]
    assert builder.calls == [
        ("create_network", False),
        ("parse_onnx", str(request.onnx)),
        ("create_config", 1 << 30),
        ("set_precision_flag", "FP16"),
        ("add_profile", (("x", (1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32)),)),
        ("add_profile", (("x", (1, 3, 64, 64), (4, 3, 64, 64), (8, 3, 64, 64)),)),
        ("set_timing_cache", b""),  # no timing cache yet: a new one
        ("set_listener",),
        ("build",),
        ("timing_cache",),
    ]
    assert outcome.built
    assert outcome.plan.read_bytes() == b"PLAN"
    timing = cache.timing_cache_path(request.repository, "10.3.0", H200)
    assert timing.read_bytes() == b"+timings"


def test_a_tensorrt_11_build_is_strongly_typed_with_no_precision_flag(request_for) -> None:
    builder = RecordingBuilder("11.4.0.106")
    request = request_for(onnx_precision=OnnxPrecision(qdq=False, fp16=True))
    _ensure(request, builder)
    assert builder.calls[0] == ("create_network", True)
    assert "set_precision_flag" not in builder.names()
    assert builder.names().count("add_profile") == len(PROFILES)


def test_fp16_on_11_from_an_fp32_file_is_refused_before_any_builder(request_for) -> None:
    with pytest.raises(ConfigError, match="removed the FP16 builder flag"):
        prepare(request_for(), TrtVersion.parse("11.4.0.106"), H200)


def test_too_many_profiles_are_refused_before_any_builder(request_for) -> None:
    with pytest.raises(ConfigError, match="2 optimization profiles, more than 1"):
        prepare(request_for(limits=Limits(max_profiles=1)), TrtVersion.parse("10.3.0"), H200)


def test_the_second_build_reuses_the_saved_timing_cache(request_for) -> None:
    request = request_for()
    _ensure(request, RecordingBuilder())
    again = RecordingBuilder()
    outcome, _ = _ensure(request, again, force=True)
    assert ("set_timing_cache", b"+timings") in again.calls
    assert any("reused" in n for n in outcome.notes)
    timing = cache.timing_cache_path(request.repository, "10.3.0", H200)
    assert timing.read_bytes() == b"+timings+timings"


def test_a_timing_cache_tensorrt_refuses_is_replaced_by_a_new_one(request_for) -> None:
    request = request_for()
    timing = cache.timing_cache_path(request.repository, "10.3.0", H200)
    cache.save_timing_cache(timing, b"from another device")
    builder = RecordingBuilder(accepts=lambda data: data == b"")
    outcome, _ = _ensure(request, builder)
    loads = [c for c in builder.calls if c[0] == "set_timing_cache"]
    assert loads == [("set_timing_cache", b"from another device"), ("set_timing_cache", b"")]
    assert any("refused by TensorRT: starting a new one" in n for n in outcome.notes)
    assert timing.read_bytes() == b"+timings"


def test_a_cached_plan_is_found_without_a_builder(request_for) -> None:
    request = request_for()
    first, _ = _ensure(request, RecordingBuilder())
    outcome, made = _ensure(request, RecordingBuilder())
    assert (outcome.built, outcome.plan, made) == (False, first.plan, [])


def test_force_builds_a_cached_plan_again(request_for) -> None:
    request = request_for()
    _ensure(request, RecordingBuilder())
    outcome, made = _ensure(request, RecordingBuilder(plan=b"PLAN2"), force=True)
    assert outcome.built
    assert len(made) == 1
    assert outcome.plan.read_bytes() == b"PLAN2"
    assert "rebuilt as asked (--force)" in outcome.notes


def test_a_worker_that_may_not_build_is_told_why_and_how(request_for) -> None:
    request = request_for()
    with pytest.raises(BuildError) as caught:
        _ensure(request, RecordingBuilder(), may_build=False)
    message = str(caught.value)
    assert message.startswith("model 'm': no plan in")
    assert f"carpool build-engine --repository {request.repository} m" in message


def test_a_plan_of_another_tensorrt_release_is_rebuilt_not_loaded(request_for) -> None:
    request = request_for()
    _ensure(request, RecordingBuilder("10.3.0"))
    builder = RecordingBuilder("10.16.1.11")
    outcome, made = _ensure(request, builder)
    assert made == [builder]
    assert outcome.built
    assert any("trt_version '10.3.0'" in n for n in outcome.notes)


@pytest.mark.parametrize(
    ("builder", "words"),
    [
        (RecordingBuilder(parse_errors=["node 3: unsupported op"]), "cannot parse"),
        (RecordingBuilder(plan=None), "TensorRT built no plan"),
        (RecordingBuilder(profile_index=lambda k: -1), "refused optimization profile 0"),
        (RecordingBuilder(accepts=lambda data: False), "refused a new timing cache"),
    ],
)
def test_a_failed_build_is_an_error_and_caches_nothing(request_for, builder, words) -> None:
    request = request_for()
    with pytest.raises(BuildError, match=words):
        _ensure(request, builder)
    assert not (request.folder / "plans").exists()
    assert isinstance(
        cache.lookup(request.folder, prepare(request, TrtVersion.parse("10.3.0"), H200).key),
        cache.Miss,
    )


def test_a_stored_plan_hits_under_the_prepared_key(request_for) -> None:
    request = request_for()
    outcome, _ = _ensure(request, RecordingBuilder())
    key = prepare(request, TrtVersion.parse("10.3.0"), H200).key
    assert cache.lookup(request.folder, key) == Hit(outcome.plan)


def test_a_profile_tensorrt_finds_inconsistent_is_a_refused_request(request_for) -> None:
    """IOptimizationProfile.set_shape raises RuntimeError: a ConfigError in one line."""
    request = request_for()
    builder = RecordingBuilder(
        profile_error="Shape provided for min is inconsistent with other shapes.\n  x: [1]"
    )
    with pytest.raises(ConfigError) as refused:
        _ensure(request, builder)
    assert str(refused.value) == (
        "model 'm': TensorRT refused optimization profile 0 (x [1..8, 3, 32, 32]): Shape "
        "provided for min is inconsistent with other shapes. x: [1]"
    )
    assert "build" not in builder.names()
    assert not (request.folder / "plans").exists()
