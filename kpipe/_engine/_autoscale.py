"""`workers="auto"`: how many workers a loader runs, chosen from measured timings.

Pure logic, no I/O except `cpu_limit()` (which reads the affinity mask and cgroup
files): `AutoScaler.observe(sample)` takes cumulative counters read by the caller and
returns a `Decision` or None; the caller (`AutoscaleDriver`, for a loader) starts or
retires the workers. Tested with a fake clock and scripted timings (tests/test_autoscale.py).

NOTE [ How the worker count is chosen ]
---------------------------------------
Every window (at least `interval_s` and `min_batches` consumed), from the counters'
differences over the window:

    wait share   w  = consumer's time blocked on workers / window
    step         s  = consumer's time per batch when not waiting (training step +
                      hand-over): its demand is 1/s batches per second
    batch time   b0 = worker wall time per batch, minus the time it sat in the CPU run
                      queue (Linux schedstat): what a batch costs an uncontended worker
    worker CPU   c  = worker CPU time per batch (c << b0: I/O-bound, e.g. waits on files),
                      at most its wall time: a worker counts as one CPU at most, though
                      its native pools may run several threads -- as many as its thread
                      budget, `max(1, floor(limit) // workers)` (NOTE in `_threads.py`),
                      so that workers x threads stay within the limit at every count and
                      each worker added divides the CPUs again instead of adding threads
    main CPU     m  = main-process CPU time per batch (the training step's CPU use too)
    stolen       f  = share of the CPUs' busy time the hypervisor gave to other guests
                      (/proc/stat "steal" of the affinity CPUs; 0 on bare metal)
    off-CPU time b' = b0 - c * f / (1 - f): b0 without the stolen time. A worker whose
                      CPU is stolen 40% of the time spends 1.7x its CPU time in wall
                      time: it must not look 40% I/O-bound (it did, on a shared VM)

    rate R = min(1/s, limit * (1 - f) / (c + m))
                                             what the consumer takes, and what the CPUs
                                             can make and consume together
    need   = ceil(R * b0 * HEADROOM)         workers that produce R (each makes 1/b0)
    cap    = min(floor(limit * b' / c), max_workers, max_queue)
                                             workers running flat out never use more
                                             CPU than the limit: a CPU-bound dataset
                                             gets at most `limit` workers, an I/O-bound
                                             one (c << b') more, up to `max_workers`

Add (up to `need`, at most x8 per step) only while the consumer waits (w >= `WAIT_ADD`);
retire (at most a quarter per step, not below `need`) when fewer workers would still make
R (the training step slowed, or the data got cheaper) and the consumer barely waited
(w < `WAIT_ADD`) in `PATIENCE` windows since the last window that asked for as many
workers as run or more. A change of the worker count starts a new window.
The first window opens when the workers start and closes after `first_min_batches` (2),
however short: an I/O-bound dataset (5 ms of waiting per sample, batch 32) then goes
2 -> 16 workers when its first two batches arrive, not ~0.35 s later
(scripts/bench_auto.py, workload c). Two batches are too few to tell a CPU-bound dataset
whose wall time a burst of stolen or page-fault time inflated from a partly I/O-bound one
(/proc/stat counts steal in 10 ms ticks): the first window goes past `floor(limit)` only
for a clearly I/O-bound dataset (c < b' / 2); later windows use the measured share.
The data order and each batch's randomness do not depend on the worker count (plans and
per-batch seeds are keyed on (seed, pass, position)), so changing it changes no batch.

Workers on other machines (Ray actors, `RayWorkers("auto")`): `limit` is the CPUs the
cluster's nodes offer the actors (`RayBackend.capacity()`), and the consumer's CPU is its
own machine's, so the rate is R = min(1/s, limit / c, main_limit / m); the hypervisor's
stolen time is not read (f = 0: this machine's /proc/stat says nothing of theirs), and
`max_workers` is also what the cluster can place. Both are read again every `REFIT_S` while
the loader runs, so a cluster that grows (nodes added by `ray start` or the autoscaler) is
used beyond the size it had when the workers started, and one that shrank is not asked for
more actors than it can place. A shrink never retires actors by itself: the replacements of
actors lost with a node wait for Ray to place them (at once when a node returns; their
demand is what Ray's autoscaler adds nodes for), so figures read below the actors held
(live and waiting) leave the last ones standing.
"""

import dataclasses
import logging
import math
import os
import time

WAIT_ADD = 0.05  # consumer wait share from which workers are added (below: may retire)
PATIENCE = 2
HEADROOM = 1.1  # batch times vary: a little more than the mean rate needs
GROWTH = 8  # at most x8 workers per decision
WORKERS_PER_CPU = 8  # the hard cap for I/O-bound work, per CPU of the limit ...
MAX_WORKERS = 64  # ... and overall
REFIT_S = 3.0  # workers on other machines: the cluster's capacity is read again this often
MAX_STOLEN = 0.9  # a stolen share read above this (10 ms ticks over a short window) is noise
logger = logging.getLogger("kpipe")


def max_workers_for(limit):
    """The most workers `workers="auto"` runs with `limit` CPUs: I/O-bound workers use
    little CPU but each is a process with its own memory and batches in flight."""
    return max(1, min(MAX_WORKERS, int(WORKERS_PER_CPU * max(1.0, limit))))


def start_workers_for(limit):
    """Workers to start with: small (2, or 1 with a single CPU)."""
    return 1 if limit < 2 else 2


@dataclasses.dataclass(frozen=True)
class Sample:
    """Cumulative counters read at one moment.

    Attributes:
        t: Clock reading, seconds.
        workers: Workers running now.
        consumed: Batches handed to the consumer so far.
        wait_s: Seconds the consumer blocked waiting for workers so far.
        main_cpu_s: CPU seconds of the main process (all its threads) so far.
        done: Batches finished by workers so far.
        busy_s: Worker wall seconds spent on those batches.
        cpu_s: Worker CPU seconds spent on those batches.
        runq_s: Seconds those workers waited for a CPU while loading (0 if unknown).
        stolen_s: CPU seconds the hypervisor took from the affinity CPUs so far
            (`CpuClock`; 0 if unknown).
        cpus_busy_s: CPU seconds those CPUs ran anything so far (0 if unknown).
    """

    t: float
    workers: int
    consumed: int
    wait_s: float
    main_cpu_s: float
    done: int
    busy_s: float
    cpu_s: float
    runq_s: float = 0.0
    stolen_s: float = 0.0
    cpus_busy_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """A change of the worker count, with the figures it rests on (all per window)."""

    t: float
    workers_from: int
    workers_to: int
    reason: str
    wait_share: float
    step_ms: float
    batch_ms: float
    worker_cpu_share: float
    main_cpu_ms: float
    rate_per_s: float
    stolen_share: float = 0.0

    def as_dict(self):
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


class AutoScaler:
    """Chooses the worker count from `Sample`s (see the NOTE above). Not thread-safe.

    Args:
        cpu_limit: CPUs this process may use (`cpu_limit()`).
        max_workers: Never more workers than this.
        interval_s: Shortest window between decisions, in seconds of `Sample.t`
            (short: in a short run, the time at too few workers counts). Defaults to 0.25.
        min_batches: Fewest batches consumed (and loaded) in a window. Defaults to 4.
        first_min_batches: The same for the first window after construction or `reset()`,
            which the caller opens when the workers start and which has no shortest
            length: their start-up and first batches already tell an I/O-bound dataset
            (add workers at once) from a CPU-bound one. Defaults to 2.
        main_cpu_limit: CPUs of the consumer's machine where the workers run on others
            (`cpu_limit` is then theirs). Defaults to None: workers and consumer share
            `cpu_limit`.
    """

    def __init__(self, cpu_limit, max_workers, *, interval_s=0.25, min_batches=4, first_min_batches=2,
                 main_cpu_limit=None):
        if not cpu_limit > 0:
            raise ValueError(f"`cpu_limit` must be > 0. Received: cpu_limit={cpu_limit!r}.")
        if max_workers < 1:
            raise ValueError(f"`max_workers` must be >= 1. Received: max_workers={max_workers!r}.")
        if min_batches < 1 or first_min_batches < 1:
            raise ValueError(f"`min_batches` and `first_min_batches` must be >= 1. Received: min_batches={min_batches!r}, "
                             f"first_min_batches={first_min_batches!r}.")
        self.cpu_limit = float(cpu_limit)
        self.max_workers = int(max_workers)
        self.main_cpu_limit = None if main_cpu_limit is None else float(main_cpu_limit)
        self.interval_s = float(interval_s)
        self.min_batches = int(min_batches)
        self.first_min_batches = int(first_min_batches)
        self._last = None
        self._quiet = 0  # windows in a row in which the consumer did not wait
        self._first = True  # the window in progress is the first since construction/reset

    @property
    def in_first_window(self):
        """True until the first window since construction/`reset()` closes: the caller
        should then read the counters at every batch, not at its usual pace."""
        return self._first

    def reset(self):
        """Forgets the window in progress (e.g. the workers were restarted)."""
        self._last = None
        self._quiet = 0
        self._first = True

    def observe(self, s):
        """Takes counters read now; returns a `Decision` when the count should change."""
        last = self._last
        if last is None or s.workers != last.workers or s.consumed < last.consumed or s.done < last.done:
            self._last = s  # the first reading, or the worker count changed: a new window
            return None
        dt = s.t - last.t
        consumed, done = s.consumed - last.consumed, s.done - last.done
        # The first window is as long as its first batches take; later ones last interval_s.
        fewest, shortest = (self.first_min_batches, 0.0) if self._first else (self.min_batches, self.interval_s)
        if dt <= shortest or consumed < fewest or done < min(fewest, s.workers):
            return None  # the window goes on
        self._last = s
        wait = min(max(s.wait_s - last.wait_s, 0.0), dt)
        busy = max(s.busy_s - last.busy_s, 1e-9)
        cpu = min(max(s.cpu_s - last.cpu_s, 0.0), busy)
        runq = min(max(s.runq_s - last.runq_s, 0.0), busy - cpu)
        stolen, cpus_busy = max(s.stolen_s - last.stolen_s, 0.0), max(s.cpus_busy_s - last.cpus_busy_s, 0.0)
        f = min(stolen / (stolen + cpus_busy), MAX_STOLEN) if stolen > 0 else 0.0
        first, self._first = self._first, False
        wait_share = wait / dt
        step = max((dt - wait) / consumed, 1e-6)
        b0 = max((busy - runq) / done, 1e-6)
        c = cpu / done
        off = max(b0 - c * f / (1.0 - f), c, 1e-6)  # b0 without stolen time
        m = max(s.main_cpu_s - last.main_cpu_s, 0.0) / consumed
        if self.main_cpu_limit is None:  # the workers' CPUs are the consumer's
            rate = min(1.0 / step, self.cpu_limit * (1.0 - f) / max(c + m, 1e-9))
        else:  # the workers' CPUs are other machines'
            rate = min(1.0 / step, self.cpu_limit / max(c, 1e-9), self.main_cpu_limit / max(m, 1e-9))
        cap = self.max_workers if c <= 0 else max(1, min(self.max_workers, math.floor(self.cpu_limit * off / c + 1e-9)))
        if first and c >= 0.5 * off:  # two batches do not show a partly I/O-bound dataset
            cap = min(cap, max(1, math.floor(self.cpu_limit + 1e-9)))
        need = max(1, min(cap, math.ceil(rate * b0 * HEADROOM - 1e-9)))
        n = s.workers
        target = n
        if n > cap:
            target, why = cap, "more workers than the CPUs can run"
        elif need > n:
            self._quiet = 0
            if wait_share >= WAIT_ADD:
                target, why = min(need, n * GROWTH), "adding workers"
        elif need < n and wait_share < WAIT_ADD:
            # (a window in which the consumer waited although enough workers run, e.g.
            # refilling after a pass of a dataset with epoch hooks, neither counts nor resets)
            self._quiet += 1
            if self._quiet >= PATIENCE:
                target, why = max(need, n - max(1, n // 4)), "retiring idle workers"
        elif need == n:
            self._quiet = 0
        if target == n:
            return None
        self._quiet = 0
        kind = "I/O-bound" if c < 0.5 * off else "CPU-bound"
        stolen_note = f", {f:.0%} of the CPUs' time stolen" if f >= 0.005 else ""
        reason = (
            f"{why}: the consumer waited {wait_share:.0%} of {dt:.2f} s; a batch takes a worker {b0 * 1e3:.1f} ms "
            f"({c / off:.0%} CPU, {kind}{stolen_note}), the consumer {step * 1e3:.2f} ms: {need} workers make "
            f"{rate:.0f} batches/s (at most {cap}: {self.cpu_limit:g} CPUs, max {self.max_workers})"
        )
        return Decision(
            t=s.t, workers_from=n, workers_to=target, reason=reason, wait_share=wait_share, step_ms=step * 1e3,
            batch_ms=b0 * 1e3, worker_cpu_share=c / off, main_cpu_ms=m * 1e3, rate_per_s=rate, stolen_share=f,
        )


# ------------------------------------------------------------------ the CPU limit
def cpu_limit(*, affinity=None, proc_cgroup="/proc/self/cgroup", cgroup_root="/sys/fs/cgroup"):
    """CPUs this process may use: the affinity mask, lowered by a cgroup CPU quota
    (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`) on its cgroup or an
    ancestor. Not `os.cpu_count()`, which counts the host's CPUs in a container.

    Args:
        affinity: CPUs of the affinity mask. Defaults to None (`os.sched_getaffinity`,
            or `os.cpu_count()` where there is none).
        proc_cgroup: The process's cgroup file. Defaults to "/proc/self/cgroup".
        cgroup_root: Where the cgroup filesystem is mounted. Defaults to "/sys/fs/cgroup".

    Returns:
        A float > 0 (a quota may allow a fraction of a CPU, e.g. 1.5).
    """
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
    limit = float(max(1, affinity))
    quota = cgroup_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        limit = min(limit, quota)
    return max(limit, 0.01)


def cgroup_quota(proc_cgroup="/proc/self/cgroup", cgroup_root="/sys/fs/cgroup"):
    """The smallest CPU quota (in CPUs) on this process's cgroup path, or None."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2
            for d in _ancestors(cgroup_root, path):
                quotas.append(_read_v2(os.path.join(d, "cpu.max")))
        elif "cpu" in controllers.split(","):
            for mount in {controllers, "cpu", "cpu,cpuacct"}:
                for d in _ancestors(os.path.join(cgroup_root, mount), path):
                    quotas.append(_read_v1(d))
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _ancestors(root, path):
    """`root/path` and each of its parents up to `root` (a container often sees its
    cgroup at "/" while the path names the host's)."""
    parts = [p for p in path.strip("/").split("/") if p]
    out = [os.path.join(root, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in out if os.path.isdir(d)]


def _read_v2(path):
    try:
        with open(path) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _read_v1(directory):
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


# ------------------------------------------------------------------ stolen CPU time
class CpuClock:
    """Reads, for the CPUs of this process's affinity mask, the CPU seconds the hypervisor
    gave to other guests ("steal") and the seconds they ran anything, from /proc/stat.
    Both are 0 where the file is missing (not Linux) or unreadable. The file is opened
    for each reading (no descriptor is held): ~60 us on 2 CPUs; the loader reads it at
    most every 20 ms.

    Args:
        path: The kernel's CPU statistics. Defaults to "/proc/stat".
        cpus: CPU numbers to count. Defaults to None (the affinity mask, or all).
    """

    def __init__(self, path="/proc/stat", cpus=None):
        if cpus is None:
            try:
                cpus = os.sched_getaffinity(0)
            except (AttributeError, OSError):
                cpus = None
        self._names = None if cpus is None else {f"cpu{n}".encode() for n in cpus}
        self._path = path
        try:
            self._tick = 1.0 / os.sysconf("SC_CLK_TCK")
        except (AttributeError, OSError, ValueError):
            self._tick = 0.01

    def __call__(self):
        """Returns `(stolen_s, busy_s)`, cumulative since boot."""
        try:
            with open(self._path, "rb", buffering=0) as f:
                text = f.read(1 << 20)
        except OSError:
            return 0.0, 0.0
        return self.parse(text)

    def parse(self, text):
        """`(stolen_s, busy_s)` from the text of /proc/stat (bytes)."""
        stolen = busy = 0
        for line in text.split(b"\n"):
            if not line.startswith(b"cpu"):
                break  # the per-CPU lines come first; then "intr" and the rest
            parts = line.split()
            if parts[0] == b"cpu" or (self._names is not None and parts[0] not in self._names):
                continue  # the first line sums all CPUs
            try:
                v = [int(x) for x in parts[1:9]]
            except ValueError:
                continue
            v += [0] * (8 - len(v))  # kernels before 2.6.11 have no steal column
            user, nice, system, _idle, _iowait, irq, softirq, steal = v
            stolen += steal
            busy += user + nice + system + irq + softirq  # guest time is in user already
        return stolen * self._tick, busy * self._tick


class AutoscaleDriver:
    """The thin caller around `AutoScaler` for one loader's `workers="auto"`: reads the
    counters (at every batch during the first window, then at most every `read_s`),
    feeds the controller, and adds or retires the backend's workers as it decides.
    Not thread-safe (the loader's lock).

    Args:
        max_queue_size: The loader's `max_queue_size`, if given (workers beyond the
            batches in flight would idle). Defaults to None.
        read_s: Shortest time between readings. Defaults to 0.02.
    """

    def __init__(self, max_queue_size=None, *, read_s=0.02, remote_max=None):
        limit = cpu_limit()
        self.remote = remote_max is not None
        self.max_workers = max_workers_for(limit) if not self.remote else min(MAX_WORKERS, remote_max)
        if max_queue_size is not None:
            self.max_workers = min(self.max_workers, max_queue_size)
        self.ceiling = self.max_workers
        self.cpu_limit = limit
        self.start_workers = min(start_workers_for(limit) if not self.remote else 2, self.max_workers)
        self.default_max_queue_size = max_queue_size or max(4, 2 * self.max_workers)
        self._scaler = AutoScaler(limit, self.max_workers, main_cpu_limit=limit if self.remote else None)
        self._clock = CpuClock() if not self.remote else (lambda: (0.0, 0.0))
        self._read_s = read_s
        self._next = 0.0
        self._refit_at = math.inf  # (set by fit_to)

    @classmethod
    def for_remote(cls, max_count, max_queue_size=None):
        """For workers on other machines (Ray actors): at most `max_count` (None: 64); the
        cluster's CPUs and what it can place are set when they start (`fit_to`)."""
        return cls(max_queue_size, remote_max=MAX_WORKERS if max_count is None else max_count)

    def fit_to(self, backend):
        """Workers on other machines: takes the CPUs and the most workers the backend's
        cluster offers now (`backend.capacity()`)."""
        if not self.remote:
            return
        self._refit_at = time.perf_counter() + REFIT_S
        cpus, placeable = backend.capacity()
        held = backend.num_workers  # live actors and the replacements of lost ones, waiting to be placed
        if placeable < held:  # nodes lost: what the actors held stands (their replacements wait for a node)
            cpus, placeable = max(float(cpus), self.cpu_limit), held
        self.cpu_limit = max(float(cpus), 1.0)
        self.max_workers = max(1, min(self.ceiling, placeable))
        self._scaler.cpu_limit, self._scaler.max_workers = self.cpu_limit, self.max_workers

    @staticmethod
    def check_arguments(start_method, use_threads):
        """Refuses what `workers="auto"` cannot run with (before other arguments are read)."""
        if use_threads:
            raise ValueError(
                "`workers='auto'` runs worker processes; it cannot size a thread pool. Received: "
                "workers='auto', use_threads=True. Pass a number of threads, e.g. workers=8, use_threads=True."
            )
        if start_method == "fork":
            raise ValueError(
                "`workers='auto'` starts workers during training, once TensorFlow is loaded, where "
                "forking deadlocks (keras-team/keras#11461). Received: workers='auto', start_method='fork'. "
                "Use start_method='forkserver' (the default) or 'spawn'."
            )

    def reset(self):
        """The workers (re)started: the first window opens now."""
        self._scaler.reset()

    def tick(self, backend, *, consumed, wait_s, t0, name):
        """Reads the counters if due and applies the controller's decision to `backend`.
        Returns the decision's record (`stats()["auto_decisions"]`: its figures, `t`
        seconds since `t0`, and `error` if the workers could not be changed), or None."""
        now = time.perf_counter()
        if now < self._next and not self._scaler.in_first_window:
            return None
        self._next = now + self._read_s
        if now >= self._refit_at:
            try:
                self.fit_to(backend)  # (nodes added or lost since: the cluster's capacity now)
            except Exception as exc:  # a cluster mid-change may not answer: the last figures stand
                self._refit_at = now + REFIT_S
                logger.debug("ProcessLoader(%s, workers='auto'): the cluster's capacity was not read: %s", name, exc)
        done, busy, cpu, runq = backend.timings
        stolen, cpus_busy = self._clock()
        decision = self._scaler.observe(Sample(
            t=now, workers=backend.num_workers, consumed=consumed, wait_s=wait_s,
            main_cpu_s=time.process_time(), done=done, busy_s=busy, cpu_s=cpu, runq_s=runq,
            stolen_s=stolen, cpus_busy_s=cpus_busy,
        ))
        if decision is None:
            return None
        record = dict(decision.as_dict(), t=round(now - t0, 3))
        try:
            if decision.workers_to > decision.workers_from:
                backend.add_worker(decision.workers_to - decision.workers_from)
            else:
                for _ in range(decision.workers_from - decision.workers_to):
                    backend.retire_worker()
        except Exception as exc:  # the batch in hand is fine; a broken pool restarts on next use
            record["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning("ProcessLoader(%s, workers='auto'): could not change the worker count %d -> %d: %s",
                           name, decision.workers_from, decision.workers_to, record["error"])
        if not backend.closed:
            logger.info("ProcessLoader(%s, workers='auto'): %d -> %d workers: %s",
                        name, decision.workers_from, backend.num_workers, decision.reason)
        return record
