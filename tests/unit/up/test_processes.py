"""FleetRunner with fake processes: it carries out the supervisor's actions and feeds it
the exits it sees, with a fake clock."""

from __future__ import annotations

import signal

from carpool.common.testing import FakeClock
from carpool.up.plan import FleetPlan
from carpool.up.processes import FleetRunner
from carpool.up.supervisor import RestartPolicy, Supervisor

POLICY = RestartPolicy(base_s=1.0, max_s=4.0, stable_s=10.0, max_restarts=2, stop_timeout_s=3.0)


class FakeProcess:
    """A child that exits when told to (or on a signal, unless it ignores SIGTERM)."""

    def __init__(self, pid: int, argv: list[str], ignore_term: bool) -> None:
        self.pid = pid
        self.argv = argv
        self.status: int | None = None
        self.signals: list[int] = []
        self.ignore_term = ignore_term

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL or not self.ignore_term:
            self.status = -sig


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[FakeProcess] = []
        self.ignore_term: set[str] = set()
        self.refuse = False

    def __call__(self, argv: list[str]) -> FakeProcess:
        if self.refuse:
            raise OSError("no such file")
        name = argv[argv.index("--name") + 1] if "--name" in argv else "broker"
        proc = FakeProcess(1000 + len(self.started), argv, name in self.ignore_term)
        self.started.append(proc)
        return proc

    def live(self) -> dict[str, FakeProcess]:
        out = {}
        for p in self.started:
            name = p.argv[p.argv.index("--name") + 1] if "--name" in p.argv else "broker"
            if p.status is None:
                out[name] = p
        return out


def _runner(workers: int = 2) -> tuple[FleetRunner, FakeLauncher, FakeClock]:
    launcher = FakeLauncher()
    clock = FakeClock()
    plan = FleetPlan("ipc:///tmp/f", "ipc:///tmp/b", worker_args=("--synthetic", "1", "0"))
    runner = FleetRunner(plan, Supervisor(workers, POLICY), launch=launcher, clock=clock)
    return runner, launcher, clock


def test_it_starts_the_plan_and_publishes_the_table() -> None:
    runner, launcher, _ = _runner(2)
    assert not runner.step(0.0)
    assert sorted(launcher.live()) == ["broker", "worker-0", "worker-1"]
    assert launcher.live()["worker-1"].argv[-5:] == [
        "--name",
        "worker-1",
        "--synthetic",
        "1",
        "0",
    ]
    status = runner.status()
    assert status.desired == 2
    assert [(c.name, c.pid) for c in status.children] == [
        ("broker", 1000),
        ("worker-0", 1001),
        ("worker-1", 1002),
    ]
    runner.close()


def test_a_dead_worker_is_started_again_after_its_backoff() -> None:
    runner, launcher, clock = _runner(2)
    runner.step(0.0)
    launcher.live()["worker-0"].status = -9
    runner.step(0.0)
    assert "worker-0" not in launcher.live()
    assert runner.status().children[1].pid is None
    clock.advance(1.0)
    runner.step(0.0)
    assert launcher.live()["worker-0"].pid == 1003
    assert runner.status().children[1].restarts == 1
    runner.close()


def test_a_scale_from_another_thread_is_carried_out_on_the_next_step() -> None:
    runner, launcher, _ = _runner(1)
    runner.step(0.0)
    runner.request_scale(3)
    runner.step(5.0)  # woken at once by the request: the guard is not waited out
    assert sorted(launcher.live()) == ["broker", "worker-0", "worker-1", "worker-2"]
    runner.request_scale(1)
    runner.step(5.0)
    assert sorted(launcher.live()) == ["broker", "worker-0"]
    assert runner.status().desired == 1
    runner.close()


def test_stop_terminates_the_workers_then_the_broker_and_kills_a_straggler() -> None:
    runner, launcher, clock = _runner(2)
    launcher.ignore_term.add("worker-1")
    runner.step(0.0)
    procs = launcher.live()
    runner.request_stop()
    assert not runner.step(5.0)
    assert procs["worker-0"].signals == [signal.SIGTERM]
    assert procs["worker-1"].signals == [signal.SIGTERM]
    assert procs["broker"].signals == []  # waits for the workers
    clock.advance(POLICY.stop_timeout_s)
    runner.step(0.0)  # worker-1's SIGKILL
    assert procs["worker-1"].signals == [signal.SIGTERM, signal.SIGKILL]
    runner.step(0.0)  # its exit seen: the broker's turn
    assert procs["broker"].signals == [signal.SIGTERM]
    assert runner.step(0.0)
    assert launcher.live() == {}
    runner.close()


def test_a_launch_that_fails_is_retried_then_given_up() -> None:
    runner, launcher, clock = _runner(1)
    runner.step(0.0)
    launcher.refuse = True
    launcher.live()["worker-0"].status = 1
    for _ in range(POLICY.max_restarts + 1):
        runner.step(0.0)
        clock.advance(POLICY.max_s)
    assert runner.status().children[1].state == "failed"
    runner.close()


def test_run_returns_1_when_the_broker_cannot_be_kept_running() -> None:
    runner, launcher, clock = _runner(1)
    runner.step(0.0)
    launcher.refuse = True
    launcher.live()["broker"].status = 1
    for _ in range(POLICY.max_restarts + 2):
        runner.step(0.0)
        clock.advance(POLICY.max_s)
    assert runner.supervisor.shutting_down  # the worker was asked to stop
    assert runner.run() == 1
    runner.close()


def test_the_metrics_flag_goes_only_to_the_roles_that_take_it() -> None:
    plan = FleetPlan("f", "b", metrics_base=9100, metrics_flag=frozenset({"worker"}))
    assert "--metrics" not in plan.argv("broker")
    assert plan.argv("worker-2")[-2:] == ["--metrics", "127.0.0.1:9103"]
    both = FleetPlan("f", "b", metrics_base=9100, metrics_flag=frozenset({"broker", "worker"}))
    assert both.argv("broker")[-2:] == ["--metrics", "127.0.0.1:9100"]
    assert FleetPlan("f", "b", metrics_base=65530).check(8) != []
    assert FleetPlan("f", "b", metrics_base=9100).check(8) == []
