"""`ProcessLoader(..., epoch_end_ahead=True)`: the next pass loads from a copy's hook
before the real one runs, and every batch is the one the loader gives without it."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kpipe
from kpipe import _compat
from _ahead_datasets import EXTERNAL, EditsInPlace, Grows, ReadsOutside, ReplacesArray, Reshuffles
from _datasets import Stalls
from conftest import reader_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _read(loader, passes, between=None):
    """Every batch of `passes` passes, as lists, calling `on_epoch_end()` after each pass
    as a manual loop does (kpipe runs the dataset's hook then); `between(p, i)` runs
    before batch i."""
    out = []
    for p in range(passes):
        for i in range(len(loader)):
            if between is not None:
                between(p, i)
            out.append(loader[i].tolist())
        loader.on_epoch_end()
    return out


def _both(make, passes, between=None, **kw):
    """The same reads with and without the option: (batches, stats) for each."""
    got = []
    for ahead in (False, True):
        with kpipe.ProcessLoader(make(), workers=2, seed=5, epoch_end_ahead=ahead, **kw) as loader:
            got.append((_read(loader, passes, between), loader.stats()))
    return got


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_are_those_of_the_loader_without_the_option_and_passes_load_ahead(shuffle, no_leaks):
    (plain, plain_stats), (ahead, stats) = _both(lambda: Reshuffles(n=10), 6, shuffle=shuffle)
    assert ahead == plain
    assert [b[0] for b in ahead] == [p for p in range(6) for _ in range(10)]  # each pass after its hook
    assert stats["ahead"]["kept"] >= 5 and stats["ahead"]["missed"] == stats["ahead"]["skipped"] == 0
    assert stats["ahead"]["off"] is None and "ahead" not in plain_stats
    assert stats["discards"] == plain_stats["discards"] == 0
    # the order is workers=0's (whose per-batch randomness is this process's, not reseeded)
    with kpipe.ProcessLoader(Reshuffles(n=10), workers=0, seed=5, shuffle=shuffle) as loader:
        inline = _read(loader, 6)
    drop_random = lambda rows: [r[:2] + r[3:] for r in rows]  # noqa: E731
    assert drop_random(ahead) == drop_random(inline)


def test_a_hook_drawing_from_the_global_numpy_random_draws_the_same_numbers(no_leaks):
    results = []
    for ahead in (False, True):
        np.random.seed(123)
        with kpipe.ProcessLoader(Reshuffles(n=8, global_rng=True), workers=2, seed=1, epoch_end_ahead=ahead) as loader:
            batches = _read(loader, 5)
            stats = loader.stats()
        results.append((batches, np.random.randint(1 << 30), stats))
    (plain, plain_next, _), (ahead, ahead_next, stats) = results
    assert ahead == plain and ahead_next == plain_next  # the copy's draws were given back
    assert stats["ahead"]["kept"] >= 4


def test_a_hook_reading_outside_the_dataset_misses_reloads_and_then_stops_trying(caplog, no_leaks):
    caplog.set_level(logging.INFO, logger="kpipe")

    def callback(p, i):  # set after the copy's hook ran (the last batch was sent), before the end
        if i == 8:
            EXTERNAL["scale"] = float(p + 2)

    def make():
        EXTERNAL["scale"] = 1.0  # each run starts from the same value
        return ReadsOutside(n=10)

    try:
        (plain, _), (ahead, stats) = _both(make, 5, callback)
    finally:
        EXTERNAL["scale"] = 1.0
    assert ahead == plain
    assert [b[4] for b in ahead[10:20]] == [2.0] * 10  # pass 1 has the value the real hook read
    a = stats["ahead"]
    assert a["missed"] == 2 and a["kept"] == 0 and "differs from the copy" in a["last_reason"]
    assert "2 passes in a row" in a["off"]
    assert stats["discards"] > 0
    assert any("no longer loading ahead" in r.getMessage() for r in caplog.records)


_SUGGESTION = "epoch_end_ahead=True loads the next pass"


def test_pass_start_waits_show_the_pass_end_wait_and_the_log_suggests_the_option_once(caplog, no_leaks):
    caplog.set_level(logging.INFO, logger="kpipe")
    with kpipe.ProcessLoader(Reshuffles(n=4, sleep_s=0.2), workers=2) as loader:
        _read(loader, 1)
        assert loader.stats()["pass_start_wait_s"] == 0.0  # the first pass's start is the start-up
        _read(loader, 4)
        stats = loader.stats()
    # 4 pass starts after a completed pass: each first batch was sent only after the hook
    # ran at the end of the pass before, and it sleeps 0.2 s in the worker
    assert 4 * 0.2 * 0.9 <= stats["pass_start_wait_s"] <= stats["wait_s"]
    hints = [r.getMessage() for r in caplog.records if _SUGGESTION in r.getMessage()]
    assert len(hints) == 1 and hints[0].startswith("ProcessLoader(Reshuffles): the consumer waited")


@pytest.mark.parametrize("case", ["option", "no hook", "threads"])
def test_no_suggestion_where_the_option_is_on_has_nothing_to_do_or_cannot_work(case, caplog, no_leaks):
    caplog.set_level(logging.INFO, logger="kpipe")
    make = (lambda: Stalls(n=4, every=1, stall_s=0.1)) if case == "no hook" else (lambda: Reshuffles(n=4, sleep_s=0.1))
    kw = {"epoch_end_ahead": True} if case == "option" else {"use_threads": True} if case == "threads" else {}
    with kpipe.ProcessLoader(make(), workers=2, **kw) as loader:
        _read(loader, 5)
        stats = loader.stats()
    assert 0.0 <= stats["pass_start_wait_s"] <= stats["wait_s"]
    assert not [r for r in caplog.records if _SUGGESTION in r.getMessage()]


def test_the_first_pass_after_a_restore_or_jump_is_not_a_pass_start_wait(no_leaks):
    with kpipe.ProcessLoader(Reshuffles(n=3, sleep_s=0.1), workers=2, seed=0) as loader:
        _read(loader, 1)
        state = loader.state()  # the start of pass 1
        loader[0]
        waited = loader.stats()["pass_start_wait_s"]
        assert waited > 0.0  # pass 1's first batch waited for the hook of pass 0
        loader.restore(state)  # back to that pass start: a jump, its queue dropped
        loader[0]
        assert loader.stats()["pass_start_wait_s"] == waited
    with kpipe.ProcessLoader(Reshuffles(n=3, sleep_s=0.1), workers=2, seed=0) as loader:
        loader.restore(state)
        loader[0]
        assert loader.stats()["pass_start_wait_s"] == 0.0  # a restored loader's start-up


@pytest.mark.parametrize("make, why", [(EditsInPlace, "edits a shared array in place"),
                                       (ReplacesArray, "do not hold")])
def test_a_hook_changing_shared_arrays_is_not_run_ahead(make, why, no_leaks):
    (plain, _), (ahead, stats) = _both(lambda: make(n=6), 4)
    assert ahead == plain
    assert [b[3] for b in ahead[::6]] == [0.0, 1.0, 2.0, 3.0]  # the arrays' new contents
    a = stats["ahead"]
    assert a["skipped"] == 2 and a["kept"] == a["missed"] == 0 and why in a["last_reason"] and a["off"]


def test_a_length_that_changes_every_pass_loads_ahead(no_leaks):
    (plain, _), (ahead, stats) = _both(Grows, 4)
    assert ahead == plain and len(ahead) == 4 + 5 + 6 + 7
    assert stats["ahead"]["kept"] >= 3


def test_replaying_jumping_and_restoring_around_the_copy_give_the_plain_batches(no_leaks):
    def script(loader):
        out = _read(loader, 1)
        out += [loader[i].tolist() for i in range(8)]  # pass 1 up to where the copy went out
        out += _read(loader, 1)  # index 0 again: pass 1 replayed from its start
        state = loader.state()
        out += [loader[i].tolist() for i in range(9)]
        loader.restore(state)  # back to the start of pass 2
        out += _read(loader, 1)
        loader.set_epoch(2)
        out += [loader[i].tolist() for i in range(9)]
        loader.set_epoch(3)
        out += _read(loader, 2)
        loader.restore(dict(loader.state(), position=3))  # pass 5 from its 4th batch
        out += [loader[i].tolist() for i in range(5)]  # up to where the copy went out
        out.append(loader[8].tolist())  # pass 6's 2nd batch, read before pass 5's hook ran
        out += _read(loader, 2)
        return out

    got = []
    for ahead in (False, True):
        with kpipe.ProcessLoader(Reshuffles(n=10), workers=2, seed=3, shuffle=True, epoch_end_ahead=ahead) as loader:
            got.append((script(loader), loader.stats()))
    (plain, _), (ahead, stats) = got
    assert ahead == plain
    assert stats["ahead"]["kept"] >= 2 and stats["ahead"]["missed"] == 0


def test_a_worker_killed_after_the_copy_went_out_restarts_from_the_real_state(no_leaks):
    with kpipe.ProcessLoader(Reshuffles(n=10, sleep_s=0.02), workers=2, seed=9) as plain_loader:
        plain = _read(plain_loader, 3)
    with kpipe.ProcessLoader(Reshuffles(n=10, sleep_s=0.02), workers=2, seed=9, epoch_end_ahead=True) as loader:
        got = _read(loader, 1)
        got += [loader[i].tolist() for i in range(8)]  # the copy's state is out
        os.kill(loader.stats()["pids"][0], signal.SIGKILL)
        with pytest.raises(kpipe.WorkerDiedError):
            for i in range(8, 10):
                got.append(loader[i].tolist())
        got = got[:18]
        got += [loader[i].tolist() for i in range(8, 10)]  # a new pool, from the real state
        loader.on_epoch_end()
        got += _read(loader, 1)
        stats = loader.stats()
    assert got == plain
    assert stats["restarts"] == 1


def test_the_option_is_checked_and_says_when_it_does_nothing(no_leaks):
    with pytest.raises(TypeError, match="epoch_end_ahead"):
        kpipe.ProcessLoader(Reshuffles(), workers=0, epoch_end_ahead="yes")
    with kpipe.ProcessLoader(Reshuffles(n=4), workers=0, epoch_end_ahead=True) as loader:
        _read(loader, 2)
        assert "worker processes" in loader.stats()["ahead"]["off"]
    from _datasets import Squares

    with kpipe.ProcessLoader(Squares(), workers=1, epoch_end_ahead=True) as loader:
        assert "load ahead anyway" in loader.stats()["ahead"]["off"]


@pytest.mark.slow
def test_fit_trains_as_without_the_option(no_leaks):
    # (the loader without the option against plain Keras: tests/test_passes.py. Plain
    # Keras >= 3.7 also runs on_epoch_end once before epoch 0, from EpochIterator.reset;
    # kpipe forwards no Keras epoch end, so a reshuffling dataset's first order differs.)
    import keras

    from _keras_datasets import ReplacingIds

    def train(ahead):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        with kpipe.ProcessLoader(ReplacingIds(12), workers=2, epoch_end_ahead=ahead) as loader:
            history = model.fit(loader, epochs=4, verbose=0)
            return model.get_weights(), history.history, loader.stats(), loader.dataset.ends

    plain_w, plain_h, _, plain_ends = train(False)
    w, h, stats, ends = train(True)
    assert h == plain_h and all(np.array_equal(a, b) for a, b in zip(w, plain_w)) and ends == plain_ends
    assert stats["ahead"]["kept"] >= 3


def _run_failing(ahead):
    """Reads 4 passes, calling on_epoch_end after each; the real hook of pass 1 fails
    (told after the copy's ran) and raises from that call."""
    from _ahead_datasets import FailsWhenTold

    out = []
    EXTERNAL["fail"] = False
    try:
        with kpipe.ProcessLoader(FailsWhenTold(n=10), workers=2, seed=2, epoch_end_ahead=ahead) as loader:
            for p in range(4):
                for i in range(len(loader)):
                    EXTERNAL["fail"] = p == 1 and i >= 8
                    out.append(loader[i].tolist())
                try:
                    loader.on_epoch_end()
                except RuntimeError as exc:
                    out.append(str(exc))
                EXTERNAL["fail"] = False
            return out, loader.stats()
    finally:
        EXTERNAL["fail"] = False


def test_a_real_hook_that_fails_after_the_copy_succeeded_gives_the_plain_errors_and_batches(no_leaks):
    (plain, _), (ahead, stats) = _run_failing(False), _run_failing(True)
    assert ahead == plain and "on_epoch_end failed as told" in ahead
    assert stats["ahead"]["kept"] >= 1 and stats["restarts"] == 0


def test_a_ctrl_c_while_giving_the_workers_their_state_back_leaves_no_pool_in_doubt(no_leaks):
    with kpipe.ProcessLoader(Reshuffles(n=10), workers=2, seed=4, shuffle=True) as loader:
        plain = _read(loader, 1) + [loader[i].tolist() for i in range(8)] + _read(loader, 2)
    with kpipe.ProcessLoader(Reshuffles(n=10), workers=2, seed=4, shuffle=True, epoch_end_ahead=True) as loader:
        got = _read(loader, 1) + [loader[i].tolist() for i in range(8)]  # the copy's state is out
        pids = loader.stats()["pids"]
        backend = reader_of(loader).backend
        real = backend.reset_target

        def interrupted(*args, **kw):
            backend.reset_target = real
            raise KeyboardInterrupt

        backend.reset_target = interrupted
        with pytest.raises(KeyboardInterrupt):
            loader[0]  # pass 1 again: the workers must get the state without the hook back
        got += _read(loader, 2)
        stats = loader.stats()
    assert got == plain
    assert stats["restarts"] == 1 and not set(stats["pids"]) & set(pids)  # a new pool, from the dataset


def test_auto_workers_added_while_a_pass_loads_ahead_get_the_copy_state(no_leaks):
    from tests._autoscale_datasets import Sleeps

    got = []
    for workers, ahead in ((2, False), ("auto", True)):
        with kpipe.ProcessLoader(Sleeps(n=24, wait_s=0.03), workers=workers, shuffle=True, seed=8, epoch_end_ahead=ahead) as loader:
            got.append((_read(loader, 4), loader.stats()))
    (plain, _), (ahead, stats) = got
    assert ahead == plain
    assert stats["auto_decisions"] and stats["workers"] > 2 and stats["ahead"]["kept"] >= 3


def test_fifty_passes_ahead_hold_no_more_memory_or_descriptors_than_five(no_leaks):
    from conftest import memfd_count

    with kpipe.ProcessLoader(Reshuffles(n=6, big=True), workers=2, seed=6, epoch_end_ahead=True) as loader:
        _read(loader, 5)
        fds, segments = memfd_count(), len(reader_of(loader).backend.shared.entries)
        _read(loader, 45)
        assert memfd_count() <= fds and len(reader_of(loader).backend.shared.entries) == segments == 1
        stats = loader.stats()
    assert stats["ahead"]["kept"] >= 49 and stats["passes"] == 50 and stats["discards"] == 0


def test_a_ctrl_c_while_sending_the_state_at_a_pass_end_leaves_no_pool_in_doubt(no_leaks):
    # without the option: the state after on_epoch_end reached some workers, or none
    with kpipe.ProcessLoader(Reshuffles(n=6), workers=2, seed=4) as loader:
        plain = _read(loader, 3)
    with kpipe.ProcessLoader(Reshuffles(n=6), workers=2, seed=4) as loader:
        got = [loader[i].tolist() for i in range(6)]
        backend, pids = reader_of(loader).backend, loader.stats()["pids"]
        real = backend.reset_target

        def interrupted(*args, **kw):
            backend.reset_target = real
            raise KeyboardInterrupt

        backend.reset_target = interrupted
        with pytest.raises(KeyboardInterrupt):
            loader.on_epoch_end()  # the hook ran; the interrupt comes while its state is sent
        got += _read(loader, 2)
        stats = loader.stats()
    assert got == plain
    assert stats["restarts"] == 1 and not set(stats["pids"]) & set(pids)


@pytest.mark.slow
def test_keras_probes_a_dropped_evaluate_and_shards_around_the_copy_train_as_without_the_option(no_leaks):
    # a strategy makes Keras pull batches to build the model (probes); evaluate(steps=3)
    # drops its stream mid-pass, so the next fit() replays that pass from its start
    import keras
    import tensorflow as tf

    from _keras_datasets import ReplacingIds

    def train(ahead):
        keras.utils.set_random_seed(0)
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        with kpipe.ProcessLoader(ReplacingIds(12), workers=2, num_shards=2, shard_index=1, shuffle=True, seed=3,
                                 epoch_end_ahead=ahead) as loader:
            logs = [model.fit(loader, epochs=2, verbose=0).history]
            logs.append(model.evaluate(loader, steps=3, verbose=0))
            logs.append(model.fit(loader, epochs=3, verbose=0).history)
            return model.get_weights(), logs, loader.stats()

    plain_w, plain_logs, plain_stats = train(False)
    w, logs, stats = train(True)
    assert logs == plain_logs and all(np.array_equal(a, b) for a, b in zip(w, plain_w))
    # (a call's last pass is not loaded ahead: Keras's next call starts with its own on_epoch_end)
    assert stats["passes"] == plain_stats["passes"] and stats["ahead"]["kept"] >= 2


def test_loaders_dropped_unclosed_while_a_pass_loads_ahead_leave_nothing(no_leaks):
    # A notebook cell re-run three times: the name is rebound, nothing is closed, and the
    # batches the cell kept are still referenced while the workers load the next pass.
    import gc

    from conftest import gone, kpipe_children, memfd_count

    with kpipe.ProcessLoader(Reshuffles(n=6, big=True), workers=2, seed=6) as plain:
        want = _read(plain, 2) + [plain[i].tolist() for i in range(4)]
    fds0, maps0, held, pids = memfd_count(), _slot_mappings(), [], []
    loader = None
    for _ in range(3):
        loader = kpipe.ProcessLoader(Reshuffles(n=6, big=True), workers=2, seed=6, epoch_end_ahead=True)
        batches = []
        for _ in range(2):
            batches += [loader[i] for i in range(len(loader))]
            loader.on_epoch_end()
        batches += [loader[i] for i in range(4)]
        # passes 1 and 2 were loaded ahead; pass 2 is all sent, so pass 3's state is out
        assert reader_of(loader).ahead.current is not None and loader.stats()["ahead"]["kept"] == 2
        held.append(batches)
        pids += loader.stats()["pids"]
    del loader, batches
    gc.collect()
    assert gone(pids, within_s=15) and not [p for p in kpipe_children() if p.pid in pids]
    assert all([b.tolist() for b in kept] == want for kept in held)  # their slots outlive the loaders
    assert _slot_mappings() > maps0
    del held
    gc.collect()
    assert memfd_count() <= fds0 and _slot_mappings() <= maps0  # and go with the last batch


def _slot_mappings():
    """This process's mappings of kpipe shared memory."""
    with open("/proc/self/maps") as f:
        return sum("memfd:kpipe" in line for line in f)


_AHEAD_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises even if started with SIGINT ignored
    sys.path.insert(0, {tests!r})
    import kpipe
    from _ahead_datasets import Reshuffles
    from kpipe._stream import source_of as reader_of

    if __name__ == '__main__':
        loader = kpipe.ProcessLoader(Reshuffles(n=6, big=True, sleep_s=0.02), workers=2, epoch_end_ahead=True)
        server = reader_of(loader).backend._zygote  # the fork server, where there is one
        print('PIDS', *loader.stats()['pids'], *([server.pid] if server is not None else []), flush=True)
        for _ in range(2):
            for i in range(len(loader)):
                loader[i]
            loader.on_epoch_end()
        for i in range(4):  # (max_queue_size 4): all of pass 2 is sent, then pass 3's state
            loader[i]
        assert reader_of(loader).ahead.current is not None and loader.stats()['ahead']['kept'] == 2
        print('AHEAD', flush=True)
        if sys.argv[1] == 'exit':
            sys.exit(0)  # no close(), a pass loading ahead: interpreter exit must stop the workers
        while True:  # killed or interrupted while passes load ahead
            for i in range(len(loader)):
                loader[i]
            loader.on_epoch_end()
    """
)


@pytest.mark.parametrize("how", ["exit", "sigint", "sigkill"])
def test_the_main_process_ending_while_a_pass_loads_ahead_leaves_no_worker_or_segment(tmp_path, how):
    from conftest import gone, killed_at_exit, orphaned_shm, shm_entries

    script = tmp_path / "ahead_main.py"
    script.write_text(_AHEAD_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__))))
    shm0 = shm_entries()
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with killed_at_exit(proc):
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("AHEAD"):
                break
        assert lines and lines[-1].startswith("AHEAD"), "".join(lines) + proc.stderr.read()
        pids = [int(p) for p in lines[0].split()[1:]]
        assert len(pids) >= 2
        if how == "sigint":
            time.sleep(0.3)  # in the endless loop, at a pass end or loading
            proc.send_signal(signal.SIGINT)
        elif how == "sigkill":
            time.sleep(0.3)
            proc.kill()
        _, err = proc.communicate(timeout=60)
    if how == "exit":
        assert proc.returncode == 0, err
    elif how == "sigint":
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert gone(pids, within_s=15)
    assert orphaned_shm(shm_entries() - shm0) == set()  # (entries no process uses: another run's are not ours)
