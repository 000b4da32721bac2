"""TensorRTEngine's logic against a recording fake of the tensorrt adapter and of CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.common.errors import ConfigError
from carpool.common.shape_rules import ShapeRule
from carpool.worker.cuda.base import CudaError
from carpool.worker.cuda.fake import FakeCuda
from carpool.worker.engines.base import BadInput, queue_depth
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.engines.trt import TensorRTEngine
from carpool.worker.engines.trt_plan import TensorIO
from carpool.worker.shapes import InputConfig, ModelShapes
from carpool.worker.warmup import warm_up
from tests.unit.worker.trt_fakes import FakePlan, expected


def _engine(**plan_args):
    cuda = FakeCuda()
    plan = FakePlan(cuda, **plan_args)
    return TensorRTEngine(plan, cuda), plan, cuda


def _x(batch: int, width: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, width)).astype(np.float32)


def test_outputs_come_from_the_device_buffers_the_engine_set():
    engine, _, _ = _engine()
    for batch, width in [(1, 4), (3, 8), (12, 6)]:
        x = _x(batch, width)
        np.testing.assert_allclose(engine.run({"x": x})["y"], expected(x)["y"])


def test_info_comes_from_the_profiles():
    engine, _, _ = _engine()
    info = engine.info
    assert info.io.max_batch == 16
    assert info.io.preferred_batch == (2, 8)  # the opt batch sizes
    assert info.io.rules[0].min_shape == (1, 4)
    assert info.io.rules[0].max_shape == (16, 8)
    assert info.warmup == (((2, 8),), ((8, 8),))  # each profile's opt shape
    assert [t.shape for t in info.io.inputs] == [(-1, -1)]


@pytest.mark.parametrize(
    ("declared", "rule"),
    [
        (InputConfig(), ShapeRule((1, 4), (16, 8))),  # none declared: the profiles'
        # wider than the profiles: the profiles' (the broker refuses what no profile takes)
        (InputConfig(min_shape=(1, 1), max_shape=(-1, -1)), ShapeRule((1, 4), (16, 8))),
        # narrower: the declared (with its multiple_of)
        (
            InputConfig(min_shape=(1, 6), max_shape=(-1, 7), multiple_of=(1, 2)),
            ShapeRule((1, 6), (16, 7), (1, 2)),
        ),
    ],
    ids=["none", "wider", "narrower"],
)
def test_a_declared_shape_rule_only_narrows_the_profiles(declared, rule):
    cuda = FakeCuda()
    shapes = ModelShapes(inputs={"x": declared})
    engine = TensorRTEngine(FakePlan(cuda), cuda, shapes=shapes)
    assert engine.info.io.rules == (rule,)
    assert engine.info.io.max_batch == 16
    assert engine.info.io.preferred_batch == (2, 8)


def test_declared_warm_up_shapes_run_after_every_profiles_opt_shape():
    cuda = FakeCuda()
    # (3, 6) is in a profile; (2, 20) is in none and is left out
    shapes = ModelShapes(warmup={"x": ((3, 6), (2, 20), (8, 8))})
    engine = TensorRTEngine(FakePlan(cuda), cuda, shapes=shapes)
    assert engine.info.warmup == (((2, 8),), ((8, 8),), ((3, 6),))


def test_each_batch_runs_in_the_tightest_profile_that_admits_its_shape():
    engine, plan, _ = _engine(profiles=None)
    engine.run({"x": _x(3)})  # both admit 3: the small one
    engine.run({"x": _x(9)})  # only the large one
    engine.run({"x": _x(4)})  # small again
    executed = [(p, c[2][0]) for ctx in plan.contexts for p, c in _profiles_at_execute(ctx.calls)]
    assert sorted(executed, key=lambda e: e[1]) == [(0, 3), (0, 4), (1, 9)]


def _profiles_at_execute(calls):
    profile = None
    for call in calls:
        if call[0] == "profile":
            profile = call[1]
        elif call[0] == "execute":
            yield profile, call


@pytest.mark.parametrize(
    ("batch", "width", "reason"),
    [(17, 8, "the batch (dim 0) is 17"), (2, 3, "dim 1 is 3"), (2, 9, "dim 1 is 9")],
)
def test_a_shape_outside_every_profile_is_refused_before_the_device(batch, width, reason):
    engine, plan, cuda = _engine()
    before = len(cuda.calls)
    with pytest.raises(BadInput, match="outside every optimization profile") as refused:
        engine.run({"x": _x(batch, width)})
    assert reason in str(refused.value)
    assert cuda.calls[before:] == []  # nothing queued, nothing copied
    assert not any(c[0] == "execute" for ctx in plan.contexts for c in ctx.calls)


def test_no_allocation_after_warm_up():
    engine, _, cuda = _engine(positions=True)
    warm_up(engine, "m")
    made = cuda.allocations
    for i, (batch, width) in enumerate([(1, 4), (16, 8), (4, 5), (9, 7), (2, 8)] * 4):
        x = _x(batch, width, seed=i)
        outputs = engine.run({"x": x})
        for name, want in expected(x).items():
            np.testing.assert_array_equal(outputs[name], want)
    assert cuda.allocations == made
    assert not any(c[0] == "free" for c in cuda.calls)


def test_buffers_are_sized_for_each_profiles_max():
    engine, _, cuda = _engine(positions=True)
    assert [p.nbytes for p in engine.plans] == [
        {"x": 4 * 8 * 4, "y": 4 * 8 * 4, "pos": 4 * 8 * 4},
        {"x": 16 * 8 * 4, "y": 16 * 8 * 4, "pos": 16 * 8 * 4},
    ]
    assert all(p.data_dependent == {"pos"} for p in engine.plans)
    # one buffer set per context (a context runs one profile at a time): two contexts ×
    # three tensors, each at the largest profile's max
    for kind in ("pinned", "device_buffer"):
        assert [c[1] for c in cuda.calls if c[0] == kind] == [512] * 6


def test_contexts_take_batches_in_turn_each_on_its_own_stream():
    engine, plan, cuda = _engine()
    first = engine.enqueue({"x": _x(2)})
    second = engine.enqueue({"x": _x(3)})
    third_x = _x(4)
    # the second batch's copy in was queued before anything waited for the first
    waits = [i for i, c in enumerate(cuda.calls) if c[0] == "wait"]
    copies = [c for c in cuda.calls if c[0] == "to_device"]
    assert waits == []
    assert copies[0][4] != copies[1][4]  # two streams
    assert first.slot is not second.slot
    third = engine.enqueue({"x": third_x})  # the first context again: its batch collected
    assert third.slot is first.slot
    assert first.outputs is not None
    np.testing.assert_allclose(third.result()["y"], expected(third_x)["y"])
    assert [len([c for c in ctx.calls if c[0] == "execute"]) for ctx in plan.contexts] == [2, 1]


def test_one_batchs_copies_overlap_the_others_compute():
    cuda = FakeCuda(copy_s=0.002)
    engine = TensorRTEngine(FakePlan(cuda, cost_s=0.010), cuda)
    engine.enqueue({"x": _x(2)})
    engine.enqueue({"x": _x(2)})
    (s1, _, start1, end1), (s2, _, start2, _) = cuda.kernels
    assert s1 != s2
    assert start1 == pytest.approx(0.002)  # after its own copy in
    assert start2 == pytest.approx(end1)  # the second copy in ran under the first kernel
    engine.close()


def test_the_worker_may_queue_as_many_batches_as_the_engine_has_contexts():
    cuda = FakeCuda()
    assert queue_depth(TensorRTEngine(FakePlan(cuda), cuda, contexts=3)) == 3
    assert queue_depth(SyntheticEngine()) == 1


def test_results_collected_out_of_order_are_each_their_own():
    engine, _, _ = _engine()
    xs = [_x(2, seed=1), _x(5, seed=2)]
    pending = [engine.enqueue({"x": x}) for x in xs]
    second = pending[1].result()  # collects the first on the way
    np.testing.assert_allclose(pending[0].result()["y"], expected(xs[0])["y"])
    np.testing.assert_allclose(second["y"], expected(xs[1])["y"])


def test_data_dependent_outputs_go_through_the_output_allocator():
    engine, plan, _ = _engine(positions=True)
    x = np.array([[1, -1, 2, 0, 3], [-1] * 4 + [5]], np.float32)
    out = engine.run({"x": x})
    np.testing.assert_array_equal(out["pos"], [[0, 2, 4, -1, -1], [4, -1, -1, -1, -1]])
    assert all("pos" in ctx.stores for ctx in plan.contexts)
    # no address set for it: TensorRT asks its allocator
    assert not any(c[:2] == ("address", "pos") for ctx in plan.contexts for c in ctx.calls)


def test_warm_up_runs_every_profiles_opt_shape():
    engine, plan, _ = _engine()
    warm_up(engine, "m")
    executed = {c[2] for ctx in plan.contexts for c in ctx.calls if c[0] == "execute"}
    assert {(2, 8), (8, 8)} <= executed


def test_busy_time_comes_from_the_events_not_the_wall_clock():
    engine, _, cuda = _engine(cost_s=0.010)
    for _ in range(3):
        engine.run({"x": _x(2)})
        cuda.host_s += 1.0  # the host idles a second between batches
    assert engine.busy_s() == pytest.approx(0.030)
    assert sum(1 for c in cuda.calls if c[0] == "elapsed_s") >= 3


def test_busy_time_of_queued_batches_counts_the_device_once():
    engine, _, _ = _engine(cost_s=0.010)
    pending = [engine.enqueue({"x": _x(2)}) for _ in range(2)]
    pending[1].result()
    assert engine.busy_s() == pytest.approx(0.020)  # one compute engine, kernels in turn


def test_a_failed_execute_raises():
    engine, plan, _ = _engine()
    plan.fail = True
    with pytest.raises(RuntimeError, match="execute_async_v3"):
        engine.run({"x": _x(2)})


def test_a_missing_input_is_bad_input():
    engine, _, _ = _engine()
    with pytest.raises(BadInput, match="missing"):
        engine.run({})


def test_close_frees_everything_it_made():
    engine, plan, cuda = _engine(positions=True)
    engine.run({"x": _x(2)})
    engine.close()
    made = sum(1 for c in cuda.calls if c[0] in ("pinned", "device_buffer"))
    freed = sum(1 for c in cuda.calls if c[0] == "free")
    assert made == freed
    assert cuda.memory == {}
    assert plan.closed
    assert cuda.closed


def test_a_plan_with_a_fixed_batch_dim_is_refused():
    cuda = FakeCuda()
    plan = FakePlan(cuda)
    fixed = [TensorIO("x", True, "float32", (-1, 8)), TensorIO("y", False, "float32", (1, 8))]
    plan.tensors = lambda: fixed  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="dynamic batch dim"):
        TensorRTEngine(plan, cuda)


def _handles(cuda: FakeCuda) -> tuple[list[int], list[int]]:
    """The streams and events ``cuda`` made, and those it destroyed (sorted)."""
    made = sorted(c[1] for c in cuda.calls if c[0] in ("stream", "event"))
    destroyed = sorted(c[1] for c in cuda.calls if c[0] == "destroy")
    return made, destroyed


def test_a_batch_is_collected_by_waiting_for_its_completion_event_on_its_stream():
    engine, _, cuda = _engine()
    completion = {c[1] for c in cuda.calls if c[0] == "event" and c[2:] == ("completion",)}
    x = _x(2)
    pending = engine.enqueue({"x": x})
    before = len(cuda.calls)
    np.testing.assert_allclose(pending.result()["y"], expected(x)["y"])
    waits = [c for c in cuda.calls[before:] if c[0] in ("wait", "synchronize")]
    # one wait, on the batch's own stream; never a wait on a timing event (the fake
    # raises on one), nor a stream synchronised instead
    assert waits == [("wait", pending.slot.done.native, pending.slot.stream.handle)]
    assert pending.slot.done.native in completion
    assert not pending.slot.done.timing


def test_an_output_allocator_asked_for_more_than_its_bound_grows_host_and_device():
    engine, plan, cuda = _engine(positions=True, bound_bytes=16)
    x = np.abs(_x(4, 8)) + 1  # every value positive: pos fills its whole 128 bytes
    out = engine.run({"x": x})  # (a copy past a buffer raises in the fake)
    np.testing.assert_array_equal(out["pos"], expected(x)["pos"])
    np.testing.assert_allclose(out["y"], expected(x)["y"])
    store = plan.contexts[0].stores["pos"]
    host, device = store.buffers["pos"]
    assert (store.grown, host.nbytes, device.nbytes) == (1, 128, 128)
    engine.close()
    assert cuda.memory == {}


def test_a_shape_tensor_plan_is_refused_before_anything_is_made():
    cuda = FakeCuda()
    plan = FakePlan(cuda, shape_tensor=True)
    with pytest.raises(ConfigError) as refused:
        TensorRTEngine(plan, cuda, what="model 'm'")
    assert str(refused.value).startswith(
        "model 'm': the plan has shape tensors ['size'] (TensorRT reads their values on the "
        "host), which carpool cannot feed; "
    )
    assert "ONNX Runtime" in str(refused.value)
    assert (cuda.allocations, plan.contexts, plan.closed) == (0, [], True)


class StickyError(FakeCuda):
    """A device whose every call fails once ``broken`` (a kernel fault's sticky error):
    each call is still made (and recorded) first."""

    broken = False

    def _fail(self) -> None:
        if self.broken:
            raise CudaError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    def wait(self, done, stream):
        self._fail()
        super().wait(done, stream)

    def free(self, buffer):
        super().free(buffer)
        self._fail()

    def destroy(self, handle):
        super().destroy(handle)
        self._fail()


def test_close_after_a_cuda_error_releasing_the_context():
    cuda = StickyError()
    plan = FakePlan(cuda, positions=True)
    engine = TensorRTEngine(plan, cuda)
    engine.enqueue({"x": _x(2)})
    cuda.broken = True
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
        engine.close()
    assert cuda.closed
    assert cuda.calls[-1] == ("close",)  # last, after every other release was tried
    assert plan.closed
    assert cuda.memory == {}
    made, destroyed = _handles(cuda)
    assert destroyed == made


def test_close_destroys_every_stream_and_event_before_releasing_the_context():
    engine, _, cuda = _engine(positions=True)
    engine.run({"x": _x(2)})
    pending = engine.enqueue({"x": _x(3)})  # still queued at close: collected first
    engine.close()
    assert pending.outputs is not None
    close = cuda.calls.index(("close",))
    made, destroyed = _handles(cuda)
    assert destroyed == made  # each once
    assert not any(c[0] == "destroy" for c in cuda.calls[close:])
    # and the engine keeps none of them (a binding that frees an event when its last
    # reference goes would free it on a released context)
    assert (engine._ends, list(engine._in_flight), engine._last_end) == ([], [], None)


class OutOfMemory(FakeCuda):
    """A device whose allocation number ``fail_at`` (from 0) fails."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def _allocate(self) -> None:
        if self.allocations == self.fail_at:
            raise CudaError("cudaMalloc failed: cudaErrorMemoryAllocation")

    def pinned(self, nbytes):
        self._allocate()
        return super().pinned(nbytes)

    def device_buffer(self, nbytes):
        self._allocate()
        return super().device_buffer(nbytes)

    def stream(self):
        self._allocate()
        return super().stream()

    def event(self, *, timing=True):
        self._allocate()
        return super().event(timing=timing)


def test_an_allocation_failing_midway_through_the_engine_frees_everything_made():
    whole = FakeCuda()
    TensorRTEngine(FakePlan(whole, positions=True), whole)
    assert whole.allocations == 1 + 2 * (3 + 3 * 2) + 3  # planning stream, slots, ends
    for fail_at in range(whole.allocations):
        cuda = OutOfMemory(fail_at)
        plan = FakePlan(cuda, positions=True)
        with pytest.raises(CudaError, match="cudaErrorMemoryAllocation"):
            TensorRTEngine(plan, cuda)
        made, destroyed = _handles(cuda)
        assert (cuda.memory, destroyed, plan.closed) == ({}, made, True), fail_at
        assert not cuda.closed  # (the caller's to close: load_tensorrt does)


def test_an_output_store_that_cannot_grow_keeps_its_buffers_and_frees_them_at_close():
    cuda = OutOfMemory(fail_at=1 + 2 * (3 + 3 * 2) + 3)  # the first after the engine's
    engine = TensorRTEngine(FakePlan(cuda, positions=True, bound_bytes=16), cuda)
    with pytest.raises(CudaError, match="cudaErrorMemoryAllocation"):
        engine.run({"x": np.abs(_x(4, 8)) + 1})
    engine.close()
    assert cuda.memory == {}
