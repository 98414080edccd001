"""workers="auto": the controller on scripted timings (a fake clock), the CPU limit from
fake cgroup files, the pool adding and retiring workers, and loaders end to end."""

import math
import os

import pytest

from kpipe._engine import _autoscale
from kpipe._engine._autoscale import AutoScaler, Sample


class Script:
    """Cumulative counters driven by per-window timings: `step(...)` advances a fake
    clock by one window in which the consumer took `consumed` batches and waited
    `wait_share` of the time, and the workers finished as many batches, each taking
    `batch_s` of wall time, `cpu_s` of CPU and `runq_s` in the run queue, while the
    hypervisor took `stolen_share` of the (2) CPUs' busy time."""

    def __init__(self, workers):
        self.workers = workers
        self.t = 100.0
        self.c = dict(consumed=0, wait_s=0.0, main_cpu_s=0.0, done=0, busy_s=0.0, cpu_s=0.0, runq_s=0.0,
                      stolen_s=0.0, cpus_busy_s=0.0)

    def sample(self):
        return Sample(t=self.t, workers=self.workers, **self.c)

    def step(self, *, window_s=0.6, consumed=20, wait_share=0.9, batch_s=0.05, cpu_s=0.0005, runq_s=0.0, main_cpu_s=0.0001,
             stolen_share=0.0):
        c = self.c
        c["stolen_s"] += 2 * window_s * stolen_share
        c["cpus_busy_s"] += 2 * window_s * (1 - stolen_share)
        self.t += window_s
        c["consumed"] += consumed
        c["wait_s"] += wait_share * window_s
        c["main_cpu_s"] += main_cpu_s * consumed
        c["done"] += consumed
        c["busy_s"] += batch_s * consumed
        c["cpu_s"] += cpu_s * consumed
        c["runq_s"] += runq_s * consumed
        return self.sample()


def run(scaler, script, windows, **timings):
    """Feeds `windows` windows; applies each decision. Returns the decisions."""
    decisions = []
    scaler.observe(script.sample())
    for _ in range(windows):
        d = scaler.observe(script.step(**timings))
        if d is not None:
            assert d.workers_from == script.workers
            script.workers = d.workers_to
            decisions.append(d)
            scaler.observe(script.sample())  # the caller's next reading opens a new window
    return decisions


def test_first_window_closes_after_two_batches_later_ones_need_interval_and_min_batches():
    scaler, script = AutoScaler(2, 64, interval_s=0.5), Script(2)
    assert scaler.in_first_window
    assert scaler.observe(script.sample()) is None  # the workers start: the first window opens
    assert scaler.observe(script.step(window_s=0.1, consumed=1)) is None  # one batch: it goes on
    d = scaler.observe(script.step(window_s=0.05, consumed=1))  # two batches, 0.15 s: it closes
    assert d is not None and d.workers_from == 2 and d.workers_to > 2 and not scaler.in_first_window
    script.workers = d.workers_to
    assert scaler.observe(script.sample()) is None  # a new window
    assert scaler.observe(script.step(window_s=0.2)) is None  # shorter than interval_s
    assert scaler.observe(script.step(window_s=0.2, consumed=1)) is None  # window goes on: 0.4 s
    d = scaler.observe(script.step(window_s=0.2, consumed=1))  # 0.6 s, 22 batches
    assert d is not None and d.workers_to > d.workers_from == script.workers
    scaler2, script2 = AutoScaler(2, 16, min_batches=4), Script(2)
    scaler2.observe(script2.sample())
    assert scaler2.observe(script2.step(window_s=5.0, consumed=2, wait_share=0.0)) is None  # first: nothing to add
    assert not scaler2.in_first_window
    assert scaler2.observe(script2.step(window_s=5.0, consumed=3)) is None  # too few batches
    scaler2.reset()
    assert scaler2.in_first_window


def test_io_bound_grows_past_the_cpus_up_to_the_cap_at_most_x8_per_step():
    scaler, script = AutoScaler(2, 16), Script(2)
    decisions = run(scaler, script, 10, batch_s=0.05, cpu_s=0.0005)
    assert [(d.workers_from, d.workers_to) for d in decisions] == [(2, 16)]
    scaler, script = AutoScaler(8, 64), Script(2)
    decisions = run(scaler, script, 10, batch_s=0.05, cpu_s=0.0005, consumed=200)
    assert [(d.workers_from, d.workers_to) for d in decisions] == [(2, 16), (16, 64)]
    assert "I/O-bound" in decisions[0].reason and "waited 90%" in decisions[0].reason


def test_cpu_bound_never_exceeds_the_cpu_limit():
    for limit in (1, 1.5, 2, 4, 7):
        for runq in (0.0, 0.01, 0.03):  # contention inflates wall time; the run queue tells
            scaler, script = AutoScaler(limit, _autoscale.max_workers_for(limit)), Script(1)
            run(scaler, script, 12, batch_s=0.02 + runq, cpu_s=0.02, runq_s=runq, wait_share=0.95)
            assert 1 <= script.workers <= max(1, math.floor(limit)), (limit, runq, script.workers)
    scaler, script = AutoScaler(4, 32), Script(1)
    run(scaler, script, 6, batch_s=0.02, cpu_s=0.02, wait_share=0.95)
    assert script.workers == 4


def test_half_io_work_may_use_twice_the_cpus():
    scaler, script = AutoScaler(2, 16), Script(2)
    run(scaler, script, 6, batch_s=0.02, cpu_s=0.01, wait_share=0.95)
    assert script.workers == 4


def test_stolen_cpu_time_does_not_make_cpu_bound_work_look_io_bound():
    # On a shared VM the hypervisor takes a share f of the CPUs' time: a worker burning
    # 20 ms of CPU spends 20 / (1 - f) ms of wall time, neither in the run queue nor
    # waiting on I/O. Read from /proc/stat's steal, f is taken out of the wall time.
    for limit in (1, 2, 4):
        for f in (0.2, 0.45, 0.7):
            scaler, script = AutoScaler(limit, _autoscale.max_workers_for(limit)), Script(1)
            decisions = run(scaler, script, 12, batch_s=0.02 / (1 - f), cpu_s=0.02, wait_share=0.95, stolen_share=f)
            assert all(d.workers_to <= max(1, math.floor(limit)) for d in decisions), (limit, f, decisions)
            assert script.workers == max(1, math.floor(limit)), (limit, f, script.workers)
            if limit == 1:
                continue  # it starts with the one worker it may have
            assert decisions and all(abs(d.stolen_share - f) < 1e-6 for d in decisions)
            assert f"{f:.0%} of the CPUs' time stolen" in decisions[0].reason and "CPU-bound" in decisions[0].reason
    # the same timings without the steal reading would look ~half I/O-bound: more workers
    scaler, script = AutoScaler(2, 16), Script(1)
    run(scaler, script, 12, batch_s=0.02 / (1 - 0.45), cpu_s=0.02, wait_share=0.95)
    assert script.workers > 2
    # half I/O-bound work on stolen CPUs still gets past the CPUs: its off-CPU time is real
    scaler, script = AutoScaler(2, 16), Script(2)
    run(scaler, script, 6, batch_s=0.01 / (1 - 0.3) + 0.01, cpu_s=0.01, wait_share=0.95, stolen_share=0.3)
    assert script.workers == 4


def test_the_first_window_goes_past_the_cpus_only_for_clearly_io_bound_work():
    # two batches of 60% CPU: maybe partly I/O-bound, maybe a burst of stolen or fault
    # time -- the first decision stays within the CPUs, a later window goes past them
    scaler, script = AutoScaler(2, 16), Script(1)
    scaler.observe(script.sample())
    d = scaler.observe(script.step(window_s=0.05, consumed=2, batch_s=0.02 / 0.6, cpu_s=0.02))
    assert (d.workers_from, d.workers_to) == (1, 2) and "CPU-bound" in d.reason
    script.workers = 2
    run(scaler, script, 6, batch_s=0.02 / 0.6, cpu_s=0.02, wait_share=0.95)
    assert script.workers == 3
    # 10% CPU: the first window goes to the workers it needs at once
    scaler, script = AutoScaler(2, 16), Script(2)
    scaler.observe(script.sample())
    d = scaler.observe(script.step(window_s=0.05, consumed=2, batch_s=0.02, cpu_s=0.002))
    assert (d.workers_from, d.workers_to) == (2, 9) and "I/O-bound" in d.reason  # 400 batches/s x 20 ms x 1.1


def test_a_busy_training_step_leaves_cpu_for_itself():
    # workers need 11 ms of CPU per batch; the consumer's step takes 10 ms (of CPU) when
    # it does not wait (42 batches in the 0.42 s of 0.6 s it did not wait): on 2 CPUs
    # both together make ~95 batches/s, which 2 workers reach and 1 does not (91/s) ...
    scaler, script = AutoScaler(2, 16), Script(1)
    run(scaler, script, 6, batch_s=0.011, cpu_s=0.011, main_cpu_s=0.010, wait_share=0.3, window_s=0.6, consumed=42)
    assert script.workers == 2
    # ... but a step of 20 ms (of CPU) takes 50 batches/s, which 1 worker makes
    scaler, script = AutoScaler(2, 16), Script(1)
    run(scaler, script, 6, batch_s=0.011, cpu_s=0.011, main_cpu_s=0.020, wait_share=0.3, window_s=0.6, consumed=21)
    assert script.workers == 1
    # the same with a nearly free consumer: the CPUs are the limit, 2 workers
    scaler, script = AutoScaler(2, 16), Script(1)
    run(scaler, script, 6, batch_s=0.011, cpu_s=0.011, main_cpu_s=0.0005, wait_share=0.9)
    assert script.workers == 2


def test_no_growth_while_the_consumer_does_not_wait():
    scaler, script = AutoScaler(2, 16), Script(2)
    assert run(scaler, script, 10, batch_s=0.05, cpu_s=0.0005, wait_share=0.03, consumed=40) == []


def test_retires_gradually_when_the_step_slows_down_and_only_after_patience():
    scaler, script = AutoScaler(2, 16), Script(16)
    scaler.observe(script.sample())
    # the training step now takes 30 ms per batch; 50 ms batches need ~2 workers
    slow = dict(batch_s=0.05, cpu_s=0.0005, wait_share=0.0, window_s=0.6, consumed=20)
    assert scaler.observe(script.step(**slow)) is None  # one quiet window is not enough
    d = scaler.observe(script.step(**slow))
    assert (d.workers_from, d.workers_to) == (16, 12) and "retiring" in d.reason
    script.workers = 12
    decisions = [d] + run(scaler, script, 20, **slow)
    assert [x.workers_to for x in decisions] == [12, 9, 7, 6, 5, 4, 3, 2]
    assert script.workers == math.ceil(20 / 0.6 * 0.05 * _autoscale.HEADROOM)


def test_patience_counts_surplus_windows_and_restarts_when_all_workers_are_needed():
    scaler, script = AutoScaler(2, 16), Script(8)
    scaler.observe(script.sample())
    quiet = dict(batch_s=0.05, cpu_s=0.0005, wait_share=0.0, consumed=20)  # need 2 of 8
    assert scaler.observe(script.step(**quiet)) is None
    # a refill (the consumer waited, yet 8 workers are plenty): neither counts nor resets
    assert scaler.observe(script.step(batch_s=0.05, cpu_s=0.0005, wait_share=0.2, consumed=20)) is None
    busy = dict(batch_s=0.05, cpu_s=0.0005, wait_share=0.02, consumed=150)  # ~8 needed
    assert scaler.observe(script.step(**busy)) is None  # patience starts again
    assert scaler.observe(script.step(**quiet)) is None
    d = scaler.observe(script.step(**quiet))
    assert (d.workers_from, d.workers_to) == (8, 6)


def test_more_workers_than_the_cpus_allow_are_cut_at_once():
    scaler, script = AutoScaler(2, 16), Script(8)  # e.g. the data became CPU-bound
    d = run(scaler, script, 1, batch_s=0.02, cpu_s=0.02, wait_share=0.5)
    assert [(x.workers_from, x.workers_to) for x in d] == [(8, 2)]


def test_a_change_of_worker_count_under_the_controller_starts_a_new_window():
    scaler, script = AutoScaler(2, 16), Script(2)
    scaler.observe(script.sample())
    script.step()
    script.workers = 3  # e.g. the pool was restarted with another count
    assert scaler.observe(script.sample()) is None
    assert scaler.observe(script.step()) is not None


class Cluster:
    """A Ray backend's figures as `AutoscaleDriver.fit_to` reads them: what the cluster's
    live nodes place, and the actors held (live ones and replacements waiting)."""

    def __init__(self, cpus, placeable, held):
        self.figures, self.num_workers = (cpus, placeable), held

    def capacity(self):
        return self.figures


def test_a_remote_cluster_read_again_grows_the_cap_and_a_lost_node_retires_nothing():
    driver = _autoscale.AutoscaleDriver.for_remote(None)
    cluster = Cluster(4.0, 4, held=2)
    driver.fit_to(cluster)
    assert (driver.cpu_limit, driver.max_workers) == (4.0, 4)
    cluster.figures, cluster.num_workers = (2.0, 2), 4  # a node lost: 2 live actors, 2 replacements waiting
    driver.fit_to(cluster)
    assert (driver.cpu_limit, driver.max_workers) == (4.0, 4)  # the replacements stand (placed when a node returns)
    scaler, script = driver._scaler, Script(4)  # a consumer that needs them all: the controller keeps 4
    assert all(d.workers_to >= 4 for d in run(scaler, script, 6, batch_s=0.2, cpu_s=0.001))
    cluster.figures = (6.0, 6)  # a third node joined
    driver.fit_to(cluster)
    assert (driver.cpu_limit, driver.max_workers) == (6.0, 6)
    cluster.figures, cluster.num_workers = (2.0, 2), 2  # nodes gone and the actors with them: the cap follows
    driver.fit_to(cluster)
    assert (driver.cpu_limit, driver.max_workers) == (2.0, 2)


def test_controller_arguments_are_checked():
    with pytest.raises(ValueError, match="cpu_limit"):
        AutoScaler(0, 4)
    with pytest.raises(ValueError, match="max_workers"):
        AutoScaler(2, 0)
    with pytest.raises(ValueError, match="first_min_batches=0"):
        AutoScaler(2, 4, first_min_batches=0)
    assert _autoscale.max_workers_for(2) == 16 and _autoscale.max_workers_for(100) == _autoscale.MAX_WORKERS
    assert _autoscale.start_workers_for(1) == 1 and _autoscale.start_workers_for(1.5) == 1 and _autoscale.start_workers_for(8) == 2


# ------------------------------------------------------------------ CPU limit
def _cgroup(tmp_path, proc_lines, files):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("\n".join(proc_lines) + "\n")
    root = tmp_path / "fs"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    return dict(proc_cgroup=str(proc), cgroup_root=str(root))


def test_cpu_limit_from_cgroup_v2_quota_and_affinity(tmp_path):
    kw = _cgroup(tmp_path, ["0::/job/step"], {"cpu.max": "max 100000\n", "job/cpu.max": "150000 100000\n", "job/step/cpu.max": "max 100000\n"})
    assert _autoscale.cpu_limit(affinity=8, **kw) == 1.5  # an ancestor's quota counts
    assert _autoscale.cpu_limit(affinity=1, **kw) == 1.0  # the affinity mask is smaller


def test_cpu_limit_without_quota_is_the_affinity(tmp_path):
    kw = _cgroup(tmp_path, ["0::/"], {"cpu.max": "max 100000\n"})
    assert _autoscale.cpu_limit(affinity=6, **kw) == 6.0
    assert _autoscale.cpu_limit(affinity=6, proc_cgroup=str(tmp_path / "missing"), cgroup_root=str(tmp_path)) == 6.0


def test_cpu_limit_from_cgroup_v1(tmp_path):
    files = {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
             "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}
    kw = _cgroup(tmp_path, ["12:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc"], files)
    assert _autoscale.cpu_limit(affinity=16, **kw) == 3.0
    # inside the container the cgroup is mounted at its own root: "/" with no quota
    kw = _cgroup(tmp_path / "c", ["4:cpu,cpuacct:/docker/abc"], {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert _autoscale.cpu_limit(affinity=16, **kw) == 16.0


_PROC_STAT = b"""cpu  900 0 300 5000 10 0 20 150 0 0
cpu0 400 0 100 2500 5 0 10 70 0 0
cpu1 300 10 150 2500 5 0 5 50 0 0
cpu2 200 0 50 0 0 0 5 30 40 0
intr 123456 1 2 3
cpu9 1 1 1 1 1 1 1 1 0 0
"""


def test_cpu_clock_counts_the_steal_and_busy_time_of_the_affinity_cpus(tmp_path):
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    path = tmp_path / "stat"
    path.write_bytes(_PROC_STAT)
    stolen, busy = _autoscale.CpuClock(str(path), cpus={0, 2})()
    assert stolen == pytest.approx(100 * tick) and busy == pytest.approx((510 + 255) * tick)
    stolen, busy = _autoscale.CpuClock(str(path), cpus={1})()  # no line after "intr" counts
    assert stolen == pytest.approx(50 * tick) and busy == pytest.approx(465 * tick)
    assert _autoscale.CpuClock(str(tmp_path / "missing"))() == (0.0, 0.0)
    path.write_bytes(b"cpu  1 2 3 4\ncpu0 1 2 3 4\n")  # an old kernel: no steal column
    assert _autoscale.CpuClock(str(path), cpus={0})() == (0.0, pytest.approx(6 * tick))
    stolen, busy = _autoscale.CpuClock()()  # this machine: cumulative, and the file is not held open
    assert stolen >= 0 and (busy > 0 or not os.path.exists("/proc/stat"))


def test_cpu_limit_of_this_process_is_at_most_the_affinity():
    limit = _autoscale.cpu_limit()
    assert 0 < limit <= len(os.sched_getaffinity(0))


# ------------------------------------------------------------------ processes
def _items(loader, passes):
    out = []
    for _ in range(passes):
        out += [tuple(int(v) for v in loader[i]) for i in range(len(loader))]
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_pool_adds_and_retires_workers_without_losing_a_batch(start_method, no_leaks):
    from kpipe._engine._pool import ProcessBackend

    from tests._autoscale_datasets import Sleeps

    backend = ProcessBackend(Sleeps(n=32, wait_s=0.01), num_workers=1, mode="dataset", start_method=start_method,
                             timeout=60, seed=0, name="Sleeps", keep_idle=8, max_workers=4)
    try:
        seqs = [backend.submit(i, seed=i) for i in range(4)]  # all on worker 0
        assert backend.add_worker(2) == [1, 2]
        seqs += [backend.submit(i, seed=i) for i in range(4, 10)]  # least loaded first: the new ones
        assert sorted(backend._tasks[s].worker.id for s in seqs[4:]) == [1, 1, 1, 2, 2, 2]
        assert backend.retire_worker() == 2  # still has tasks: they are delivered
        seqs += [backend.submit(i, seed=i) for i in range(10, 14)]
        assert all(backend._tasks[s].worker.id != 2 for s in seqs[10:])
        got = [int(backend.get(s)[0][0]) for s in seqs]
        assert got == list(range(14))
        assert backend.num_workers == 2 and len(backend.pids) == 2
        backend.reset_target(Sleeps(n=32, wait_s=0.01))  # state to every live worker
        backend.add_worker(1)  # id 2 again once reaped, or 3; gets the current target
        assert backend.num_workers == 3
        seqs = [backend.submit(i, seed=i) for i in range(6)]
        assert [int(backend.get(s)[0][0]) for s in seqs] == list(range(6))
        with pytest.raises(ValueError, match="max_workers=4"):
            backend.add_worker(2)
        assert backend.timings[0] >= 20 and backend.timings[1] >= backend.timings[2]
    finally:
        backend.close()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_io_bound_ends_with_more_workers_than_cpu_bound_and_order_is_unchanged(no_leaks):
    import kpipe

    from tests._autoscale_datasets import Sleeps, Spins

    def load(ds, workers, passes):
        with kpipe.ProcessLoader(ds, workers=workers, shuffle=True, seed=7) as loader:
            return _items(loader, passes), loader.stats()

    io_items, io_stats = load(Sleeps(n=48, wait_s=0.05), "auto", 3)
    cpu_items, cpu_stats = load(Spins(n=48, cpu_s=0.02), "auto", 3)
    limit = cpu_stats["cpu_limit"]
    assert io_stats["workers"] > cpu_stats["workers"]
    assert io_stats["workers"] > limit and io_stats["auto_decisions"]
    assert all(d["workers_to"] <= max(1, math.floor(limit)) for d in cpu_stats["auto_decisions"])
    assert cpu_stats["workers"] <= max(1, math.floor(limit))
    # the order is that of workers=0, and each batch's randomness that of fixed workers
    order = lambda items: [x[:-1] for x in items]  # noqa: E731
    assert order(io_items) == order(load(Sleeps(n=48, wait_s=0.0), 0, 3)[0])
    assert io_items == load(Sleeps(n=48, wait_s=0.0), 2, 3)[0]
    assert order(cpu_items) == order(load(Spins(n=48, cpu_s=0.0), 0, 3)[0])
    assert cpu_items == load(Spins(n=48, cpu_s=0.0), 1, 3)[0]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_auto_retires_workers_when_the_consumer_slows_down_and_logs(caplog, no_leaks):
    import logging
    import time

    import kpipe

    from tests._autoscale_datasets import Sleeps

    caplog.set_level(logging.INFO, logger="kpipe")
    with kpipe.ProcessLoader(Sleeps(n=48, wait_s=0.05), workers="auto", shuffle=True, seed=3) as loader:
        items = []
        for _ in range(3):
            items += [tuple(int(v) for v in loader[i]) for i in range(len(loader))]
        fast_until = max((d["t"] for d in loader.stats()["auto_decisions"]), default=-1.0)
        # Then slow passes until the controller retires a worker: how many windows that
        # takes depends on the machine's speed, so the loop ends on the decision itself,
        # with a deadline that only catches a controller that never retires.
        passes, deadline = 3, time.monotonic() + 120
        while not any(d["workers_to"] < d["workers_from"] and d["t"] > fast_until for d in loader.stats()["auto_decisions"]):
            assert time.monotonic() < deadline, loader.stats()["auto_decisions"]
            for i in range(len(loader)):
                items.append(tuple(int(v) for v in loader[i]))
                time.sleep(0.03)  # the training step got slower than the workers
            passes += 1
        stats = loader.stats()
        peak = max(d["workers_to"] for d in stats["auto_decisions"])
        assert peak > stats["workers"] and len(stats["pids"]) == stats["workers"]
        assert any(d["workers_to"] < d["workers_from"] for d in stats["auto_decisions"])
    assert any("workers='auto'" in r.getMessage() and "->" in r.getMessage() for r in caplog.records)
    with kpipe.ProcessLoader(Sleeps(n=48, wait_s=0.0), workers=2, shuffle=True, seed=3) as fixed:
        assert items == _items(fixed, passes)


def test_auto_refuses_threads_and_fork():
    import kpipe

    from tests._autoscale_datasets import Sleeps

    with pytest.raises(ValueError, match="use_threads=True"):
        kpipe.ProcessLoader(Sleeps(), workers="auto", use_threads=True)
    with pytest.raises(ValueError, match="start_method='fork'"):
        kpipe.ProcessLoader(Sleeps(), workers="auto", start_method="fork")
    with pytest.raises(TypeError, match="workers='many'"):
        kpipe.ProcessLoader(Sleeps(), workers="many")
