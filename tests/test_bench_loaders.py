"""Smoke test of scripts/bench_loaders.py: every loader runs and the JSON has every row."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args, env=None, timeout=280):
    """Runs the benchmark with `--quick` and `args`; returns its stdout and JSON."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_loaders.py"), "--quick", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def by_loader(result, workload, loader):
    return next(r for r in result["rows"] if r["workload"] == workload and r["loader"] == loader)


def test_the_consumer_reads_every_page_unless_told_not_to():
    spec = importlib.util.spec_from_file_location("bench_loaders_consume", os.path.join(ROOT, "scripts", "bench_loaders.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Leaf:  # records the pages read
        itemsize, reads = 4, []

        def reshape(self, *shape):
            return self

        def __getitem__(self, index):
            Leaf.reads.append(index)
            return self

        def sum(self):
            return 0

        def __len__(self):
            return 8

    counts = [0, 0, None, 0]
    bench.consume(iter([(Leaf(), Leaf())]), counts, read=False)
    assert Leaf.reads == [] and counts[:2] == [1, 8]
    bench.consume(iter([(Leaf(), Leaf())]), counts)
    assert Leaf.reads == [slice(None, None, 1024)] * 2 and counts[:2] == [2, 16]


def _without(tmp_path, *packages):
    """An environment in which `import <package>` fails for each of `packages`, as where
    it is not installed: a package of that name on PYTHONPATH that raises ImportError."""
    fake = tmp_path / "fake-packages"
    for name in packages:
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}' (simulated)\")\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_quick_run_reports_every_loader(tmp_path):
    # the built-in loaders (the peers, whose packages are optional, have tests of their own)
    stdout, result = _run(tmp_path, "--workloads", "a", "--epochs", "1", "--warmup-epochs", "1", "--rss-epochs", "3",
                          "--loaders", "serial,keras-threads,keras-mp,tf.data,kpipe,kpipe-ahead")
    rows = result["rows"]
    assert [r["loader"] for r in rows] == ["serial", "keras-threads", "keras-mp", "tf.data", "kpipe", "ceiling"]
    assert result["skipped"] == {}
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert "Targets:" in stdout and "kpipe RSS over 3 epochs" in stdout
    assert result["warmup_epochs"] == 1 and "after 1 untimed" in stdout
    assert result["warm_mb"] == 128  # 1024 MB scaled for --quick


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_runs_the_fixed_order_workload_beside_b(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "b,b-fixed", "--loaders", "kpipe,kpipe-ahead", "--epochs", "2", "--rss-epochs", "0")
    # b has an on_epoch_end: kpipe with epoch_end_ahead=True, and the ceiling with a barrier
    # at each pass end; b-fixed has none, so neither runs there
    assert [(r["workload"], r["loader"]) for r in result["rows"]] == [
        ("b", "kpipe"), ("b", "kpipe-ahead"), ("b", "ceiling"), ("b", "ceiling-passes"), ("b-fixed", "kpipe"), ("b-fixed", "ceiling"),
    ]
    assert all(r["samples_per_s"] > 0 for r in result["rows"])
    by_ceiling = {r["workload"]: r["samples_per_s"] for r in result["rows"] if r["loader"] == "ceiling"}
    assert "(b) kpipe >= 0.85x ceiling" in stdout and "(b) kpipe epoch_end_ahead=True >= 0.85x ceiling" in stdout
    assert "(b) the ceiling with a barrier and the hook at each pass end reaches" in stdout
    # every pass end: the warm-up epoch's (the default --warmup-epochs 1) and the 2 timed ones'
    assert "kpipe-ahead: passes loaded ahead of on_epoch_end kept 3, missed 0, skipped 0" in stdout
    for r in result["rows"]:  # timed from the first batch too: the warm-up epoch included
        if not r["loader"].startswith("ceiling"):
            assert r["samples_per_s_from_first"] > 0
            assert r["x_ceiling_from_first"] == pytest.approx(r["samples_per_s_from_first"] / by_ceiling[r["workload"]])
    assert "from 1st" in stdout
    # where the CPU time went, for kpipe and the ceilings (measured), not for the others
    by_loader = {(r["workload"], r["loader"]): r for r in result["rows"]}
    for key in [("b", "kpipe"), ("b", "kpipe-ahead"), ("b", "ceiling"), ("b", "ceiling-passes"), ("b-fixed", "kpipe")]:
        cpu = by_loader[key]["cpu"]
        # a share of all CPUs: at most 1, but for clock-tick rounding between the readings of
        # each process and of /proc/stat (short runs: 1.06 seen); a share of one CPU -- the
        # unit error this guards against -- would be near 2 for these 2 busy workers
        assert cpu["worker_us_per_sample"] > 0 and 0 < cpu["workers"] <= 1.5, (key, cpu)
        assert 0 <= cpu["idle"] <= 1 and 0 <= cpu["steal"] <= 1
    assert by_loader[("b", "ceiling")]["cpu"]["main"] == 0.0 and by_loader[("b", "kpipe")]["cpu"]["main"] > 0
    assert by_loader[("b", "kpipe")]["x_ceiling_paired"] == pytest.approx(by_loader[("b", "kpipe")]["x_ceiling"])  # one round
    assert "Where the CPU time went in those best runs" in stdout
    assert "(b) kpipe >= 0.85x ceiling, paired" in stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_splits_the_np_stack_gap_into_the_barrier_and_the_slots(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "b-stack,b-stack-fixed", "--loaders", "kpipe,kpipe-ahead,kpipe-noread", "--epochs", "1",
                          "--rss-epochs", "0", "--ceiling-slots", "3")
    # b-stack-fixed has no on_epoch_end: no kpipe-ahead and no barrier there
    assert [(r["workload"], r["loader"]) for r in result["rows"]] == [
        ("b-stack", "kpipe"), ("b-stack", "kpipe-ahead"), ("b-stack", "kpipe-noread"), ("b-stack", "ceiling"), ("b-stack", "ceiling-passes"),
        ("b-stack", "ceiling-3-slots"), ("b-stack-fixed", "kpipe"), ("b-stack-fixed", "kpipe-noread"), ("b-stack-fixed", "ceiling"),
        ("b-stack-fixed", "ceiling-3-slots"),
    ]
    for workload in ("b-stack", "b-stack-fixed"):  # the consumer's reads, beside the same loader reading nothing
        assert f"({workload}) kpipe with a consumer that reads nothing of its batches reaches" in stdout
        assert by_loader(result, workload, "kpipe-noread")["cpu"]["main"] >= 0
    by = {(r["workload"], r["loader"]): r for r in result["rows"]}
    for workload in ("b-stack", "b-stack-fixed"):
        slots, ceiling = by[(workload, "ceiling-3-slots")], by[(workload, "ceiling")]
        assert slots["samples_per_s"] > 0 and slots["x_ceiling"] == pytest.approx(slots["samples_per_s"] / ceiling["samples_per_s"])
        assert slots["cpu"]["worker_us_per_sample"] > 0 and slots["cpu"]["main"] == 0.0
        assert f"({workload}) ceiling-3-slots reaches" in stdout
    assert "(b-stack) ceiling-passes reaches" in stdout
    assert "(b-stack) kpipe epoch_end_ahead=True >= 0.9x bare processes, paired" in stdout


def test_read_slots_fails_a_run_whose_batches_were_not_all_read(tmp_path):
    # two stand-in processes: one announces its batch and ends, one claims a batch it never announced
    script = ("import sys, os, mmap\n"
              "fd = os.memfd_create('s'); os.ftruncate(fd, 8192)\n"
              "print('READY', fd, flush=True); sys.stdin.readline()\n"  # (as run_ceiling's processes wait for GO)
              "announce = sys.argv[1] == '1'\n"
              "if announce:\n"
              "    print('B 0 8192', flush=True); assert sys.stdin.readline().split() == ['F', '0']\n"
              "print('DONE 1 128 0 0 0', flush=True)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, flag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for flag in ("1", "0")]
    try:
        fds = {p.pid: [int(p.stdout.readline().split()[1])] for p in procs}
        for p in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        with pytest.raises(RuntimeError, match="the reader took 1 batches of the 2 the processes wrote"):
            _bench_module()._read_slots(procs, fds)
    finally:
        for p in procs:
            p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [0, 0]


def test_ceiling_read_needs_two_slots_per_process(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_module().main(["--workloads", "b", "--ceiling-read", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ceiling-read must be 0 (off) or at least 2 slots per process" in err and "Received: 1" in err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_runs_each_loader_and_the_ceilings_for_min_seconds_and_hands_ceiling_read_every_batch(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "b", "--loaders", "kpipe,kpipe-samples", "--epochs", "1", "--min-seconds", "0.5",
                          "--rss-epochs", "0", "--ceiling-read", "2")
    assert result["min_seconds"] == 0.5
    assert [r["loader"] for r in result["rows"]] == ["kpipe", "kpipe-samples", "ceiling", "ceiling-passes", "ceiling-read",
                                                     "ceiling-read-passes"]
    by = {r["loader"]: r for r in result["rows"]}
    assert by["kpipe"]["batches"] >= 2  # whole epochs: 2 batches each at --quick sizes
    ceiling = by["ceiling"]
    assert ceiling["samples_per_s"] > 0 and by["ceiling-passes"]["samples_per_s"] > 0 and ceiling["cpu"]["main"] == 0.0
    for name in ("ceiling-read", "ceiling-read-passes"):
        read = by[name]
        assert read["samples_per_s"] > 0 and read["x_ceiling"] == pytest.approx(read["samples_per_s"] / ceiling["samples_per_s"])
        # the reads are this process's CPU (the bare ceiling's consumer does nothing); a
        # batch the reader did not take would have failed the run (see _read_slots)
        assert read["cpu"]["main"] > 0 and read["cpu"]["worker_us_per_sample"] > 0, name
    # from_samples has no pass-end barrier: set beside ceiling-read, not the passes
    line = next(x for x in stdout.splitlines() if x.startswith("(b) ceiling-read reaches"))
    assert "kpipe reaches" in line and "kpipe-samples reaches" in line
    line = next(x for x in stdout.splitlines() if x.startswith("(b) ceiling-read-passes reaches"))
    assert "kpipe reaches" in line and "kpipe-samples" not in line


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_blas_workload_at_every_worker_count_and_peers_skipped_with_their_reason(tmp_path):
    env = _without(tmp_path, "grain", "torch")
    stdout, result = _run(tmp_path, "--workloads", "blas", "--blas-workers", "1,2", "--epochs", "1", "--rss-epochs", "0",
                          "--loaders", "serial,tf.data,kpipe,grain-loader,grain-dataset,torch", env=env)
    # each peer skipped, its reason printed and in the JSON
    assert set(result["skipped"]) == {"grain-loader", "grain-dataset", "torch"}
    for loader, reason in result["skipped"].items():
        assert "(simulated)" in reason and "install" in reason, reason
        assert f"skipped {loader}: {reason}" in stdout
    assert "pip install -e '.[bench]'" in result["skipped"]["grain-loader"]
    # serial and tf.data (no worker count) once; kpipe and the ceiling at each count; kpipe at "auto" (no ceiling)
    assert [(r["workload"], r["loader"], r["workers"]) for r in result["rows"]] == [
        ("blas@1", "serial", 0), ("blas@1", "tf.data", 1), ("blas@1", "kpipe", 1), ("blas@1", "ceiling", 1),
        ("blas@2", "kpipe", 2), ("blas@2", "ceiling", 2), ("blas@auto", "kpipe", "auto"),
    ]
    by = {(r["workload"], r["loader"]): r for r in result["rows"]}
    serial = by[("blas@1", "serial")]["samples_per_s"]
    for r in result["rows"]:
        assert r["samples_per_s"] > 0 and r["x_serial"] == pytest.approx(r["samples_per_s"] / serial)
        if r["loader"] != "ceiling":  # whole epochs of 8 batches at --quick: the warm-up one and a timed one
            assert r["batches"] == 16, r
    one = by[("blas@1", "kpipe")]["samples_per_s"]
    assert by[("blas@2", "kpipe")]["x_workers1"] == pytest.approx(by[("blas@2", "kpipe")]["samples_per_s"] / one)
    assert by[("blas@auto", "kpipe")]["x_workers1"] == pytest.approx(by[("blas@auto", "kpipe")]["samples_per_s"] / one)
    assert by[("blas@auto", "kpipe")]["x_ceiling"] is None and by[("blas@auto", "kpipe")]["workers_end"] >= 1
    assert by[("blas@1", "tf.data")]["x_workers1"] is None and by[("blas@1", "serial")]["x_workers1"] is None
    # the grid and the three targets, each a PASS or MISS line (never asserted on)
    assert "BLAS workload: batches/s" in stdout and "workers=auto" in stdout
    for target in ("(blas) kpipe workers=2 >= 1.3x workers=1", "(blas) kpipe workers='auto' >= 0.9x the best fixed count",
                   "(blas) kpipe slowest fixed count"):
        line = next(line for line in stdout.splitlines() if target in line)
        assert line.split()[0] in ("PASS", "MISS"), line


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bench_loaders_runs_both_grain_rows_on_per_sample_and_per_batch_workloads(tmp_path):
    pytest.importorskip("grain", reason="grain is not installed (pip install -e '.[bench]')")
    # a: records, a random map and a batch; b: Grain's shuffle and reading threads over the
    # HDF5 file; blas: the records are whole batches
    stdout, result = _run(tmp_path, "--workloads", "a,b,blas", "--blas-workers", "2", "--epochs", "1", "--rss-epochs", "0",
                          "--loaders", "grain-loader,grain-dataset", timeout=560)
    assert result["skipped"] == {}
    assert [(r["workload"], r["loader"]) for r in result["rows"] if r["loader"].startswith("grain")] == [
        (w, k) for w in ("a", "b", "blas@2") for k in ("grain-loader", "grain-dataset")
    ]
    per_epoch = {"a": 4, "b": 2, "blas@2": 8}  # batches per epoch at --quick sizes
    for r in result["rows"]:
        assert r["samples_per_s"] > 0
        if r["loader"].startswith("grain"):
            assert r["workers"] == 2 and r["first_batch_s"] > 0 and r["samples_per_s_from_first"] > 0
            assert r["batches"] == 2 * per_epoch[r["workload"]], r  # the warm-up epoch and a timed one, whole


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_runs_pytorch_dataloader_on_the_per_batch_dataset(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (pip install torch --index-url https://download.pytorch.org/whl/cpu)")
    _, result = _run(tmp_path, "--workloads", "a,b", "--epochs", "1", "--rss-epochs", "0", "--loaders", "torch,kpipe")
    rows = [(r["workload"], r["loader"]) for r in result["rows"]]
    assert rows == [("a", "torch"), ("a", "kpipe"), ("a", "ceiling"), ("b", "torch"), ("b", "kpipe"), ("b", "ceiling"), ("b", "ceiling-passes")]
    assert all(r["samples_per_s"] > 0 for r in result["rows"])
    per_epoch = {"a": 4, "b": 2}  # batches per epoch at --quick sizes
    for r in result["rows"]:
        if r["loader"] == "torch":
            assert r["batches"] == 2 * per_epoch[r["workload"]], r  # the warm-up epoch and a timed one


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_loaders", os.path.join(ROOT, "scripts", "bench_loaders.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_min_seconds_and_epochs_are_both_minimums():
    bench = _bench_module()
    assert bench.more_epochs(0, 8, 0.0, 5.0)
    assert bench.more_epochs(3, 8, 60.0, 5.0)  # fewer epochs than asked, however long
    assert bench.more_epochs(8, 8, 4.9, 5.0)  # enough epochs, not yet long enough
    assert not bench.more_epochs(8, 8, 5.0, 5.0)
    assert not bench.more_epochs(8, 8, 0.1, 0.0)  # --min-seconds 0: the epochs alone


def test_a_negative_min_seconds_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_module().main(["--min-seconds", "-1"])
    assert exc.value.code == 2
    assert "--min-seconds must be >= 0. Received: -1.0" in capsys.readouterr().err


def test_cpu_shares_split_the_machine_time_between_two_readings():
    bench = _bench_module()
    hz = os.sysconf("SC_CLK_TCK")
    # 2 CPUs for 1 s: 2 * hz ticks, of which 10% idle and 5% stolen
    before, after = (100, 50, 1000), (100 + 0.2 * hz, 50 + 0.1 * hz, 1000 + 2 * hz)
    shares = bench.cpu_shares(1.5, 0.2, before, after, samples=3000)
    assert shares["workers"] == pytest.approx(0.75) and shares["main"] == pytest.approx(0.1)
    assert shares["idle"] == pytest.approx(0.1) and shares["steal"] == pytest.approx(0.05)
    assert shares["worker_us_per_sample"] == pytest.approx(500.0)
    assert bench.cpu_shares(1.5, 0.2, None, after, samples=3000) == {"worker_us_per_sample": pytest.approx(500.0)}  # no /proc/stat


def test_the_breakdown_multiplies_out_to_the_ratio_of_two_runs():
    bench = _bench_module()
    # a loader whose workers got 80% of the CPUs and spent 200 us per sample, against a
    # ceiling at 96% and 160 us: (0.8 / 200) / (0.96 / 160) of the ceiling's samples/s
    row = {"cpu": {"workers": 0.8, "main": 0.1, "idle": 0.05, "steal": 0.05, "worker_us_per_sample": 200.0}}
    ceiling = {"cpu": {"workers": 0.96, "main": 0.0, "idle": 0.0, "steal": 0.04, "worker_us_per_sample": 160.0}}
    split = bench.cpu_breakdown(row, ceiling)
    assert split["capacity"] == pytest.approx(0.8 / 0.96) and split["cost"] == pytest.approx(0.8)
    assert split["predicted"] == pytest.approx((0.8 / 200) / (0.96 / 160))
    assert bench.cpu_breakdown({"cpu": None}, ceiling) is None  # not measured (a Keras loader)


def test_blas_targets_compare_each_count_with_one_worker_and_auto_with_the_best():
    bench = _bench_module()
    checks = bench.blas_checks({1: 100.0, 2: 90.0, 4: 50.0, "auto": 80.0})
    assert checks == [
        ("(blas) kpipe workers=2 >= 1.3x workers=1", pytest.approx(0.9), 1.3),
        ("(blas) kpipe workers='auto' >= 0.9x the best fixed count (workers=1)", pytest.approx(0.8), 0.9),
        ("(blas) kpipe slowest fixed count (workers=4) >= 0.8x workers=1", pytest.approx(0.5), 0.8),
    ]
    assert bench.blas_checks({2: 90.0, "auto": 95.0}) == [
        ("(blas) kpipe workers='auto' >= 0.9x the best fixed count (workers=2)", pytest.approx(95 / 90), 0.9),
    ]  # without workers=1, only what can be compared


def test_checks_print_pass_or_miss_by_the_direction_their_name_says(capsys):
    bench = _bench_module()
    bench.print_checks([("x >= 1.3x y", 1.4, 1.3), ("x >= 1.3x y", 1.2, 1.3), ("first batch <= 0.5 s", 0.7, 0.5),
                        ("RSS growth < 5%", 1.0, 5.0)])
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["PASS", "MISS", "MISS", "PASS"]


def test_a_peer_whose_package_does_not_import_is_skipped_with_the_install_command(monkeypatch):
    bench = _bench_module()
    monkeypatch.setitem(sys.modules, "grain", None)  # `import grain` raises ImportError
    reason = bench.peer_missing("grain-dataset")
    assert reason.startswith("grain does not import (ModuleNotFoundError") and "pip install -e '.[bench]'" in reason
    assert bench.peer_missing("kpipe") is None and bench.peer_missing("tf.data") is None


def test_blas_worker_counts_must_be_positive_integers(capsys):
    bench = _bench_module()
    for bad in ("0,2", "one"):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--blas-workers", bad])
        assert exc.value.code == 2
        assert f"--blas-workers takes comma-separated worker counts >= 1. Received: {bad}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_bench_loaders_runs_the_per_sample_form_and_the_stacking_workload(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "b,b-stack,s,blas", "--blas-workers", "2", "--loaders", "kpipe,kpipe-samples",
                          "--epochs", "1", "--rss-epochs", "0", timeout=380)
    got = {(r["workload"], r["loader"]) for r in result["rows"]}
    # from_samples where the workload has per-sample records (b, s), not where they are whole batches (blas)
    assert {("b", "kpipe-samples"), ("s", "kpipe-samples"), ("b-stack", "kpipe"), ("b-stack", "ceiling"), ("s", "ceiling")} <= got
    assert ("blas@2", "kpipe-samples") not in got and ("b-stack", "kpipe-samples") not in got
    assert all(r["samples_per_s"] > 0 for r in result["rows"])
    for target in ("(b) kpipe-samples (from_samples) >= 0.9x the in-place ceiling",
                   "(b-stack) kpipe >= 0.9x bare processes running the same np.stack code"):
        assert target in stdout
    assert "(s) per-sample overhead of from_samples" in stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bench_loaders_jpeg_workload_runs_its_rows_in_fresh_processes_and_prints_ratios(tmp_path):
    rows = "keras-idf,kpipe-files,kpipe-packed-256,tfdata-rrc,kpipe-rrc,pil-bare,kpipe-samples-pil,torch"
    out, result = _run(tmp_path, "--workloads", "jpeg", "--jpeg-rows", rows, "--rss-epochs", "0", timeout=580)
    got = {r["loader"]: r for r in result["rows"] if r["workload"] == "jpeg"}
    expect = set(rows.split(",")) - ({"torch"} if "jpeg/torch" in result["skipped"] else set())
    assert set(got) == expect and all(r["rate"] > 0 and r["images"] == 64 for r in got.values())
    assert got["kpipe-files"]["cpu_ms"] > 0 and got["pil-bare"]["cpu_ms"] > 0 and got["kpipe-samples-pil"]["cpu_ms"] > 0
    assert "kpipe-files / keras-idf:" in out and "kpipe-rrc / tfdata-rrc:" in out and "open/list" in out
    assert "matplotlib sample_data/grace_hopper.jpg" in out or "PIL-synthesised" in out
    if "jpeg/torch" in result["skipped"]:
        assert "skipped jpeg/torch: torch is not installed" in out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bench_loaders_jpeg_packed_per_sample_rows(tmp_path):
    rows = "packed-pil-bare,kpipe-packed-pil,torch-packed,packed-cv2-bare,kpipe-packed-cv2,torch-packed-cv2"
    out, result = _run(tmp_path, "--workloads", "jpeg", "--jpeg-rows", rows, "--rss-epochs", "0", timeout=580)
    got = {r["loader"]: r for r in result["rows"] if r["workload"] == "jpeg"}
    skipped = "jpeg/torch-packed" in result["skipped"]
    assert set(got) == set(rows.split(",")) - ({"torch-packed", "torch-packed-cv2"} if skipped else set())
    assert all(r["rate"] > 0 and r["images"] == 64 and r["cpu_ms"] > 0 for r in got.values())  # (workers' CPU counted)
    assert "kpipe-packed-pil / packed-pil-bare:" in out and "kpipe-packed-cv2 / packed-cv2-bare:" in out
    if skipped:
        assert "skipped jpeg/torch-packed: torch is not installed" in out
    else:
        assert "kpipe-packed-pil / torch-packed:" in out and "kpipe-packed-cv2 / torch-packed-cv2:" in out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bench_loaders_jpeg_simplejpeg_grain_and_storage_rows(tmp_path):
    rows = "kpipe-samples-pil,kpipe-packed-pil,grain-packed,kpipe-files-sj,packed-sj-bare,kpipe-packed-sj"
    out, result = _run(tmp_path, "--workloads", "jpeg", "--jpeg-rows", rows, "--rss-epochs", "0", timeout=580)
    got = {r["loader"]: r for r in result["rows"] if r["workload"] == "jpeg"}
    skipped = {row for row in rows.split(",") if f"jpeg/{row}" in result["skipped"]}
    assert skipped <= {"grain-packed", "kpipe-files-sj", "packed-sj-bare", "kpipe-packed-sj"}  # (peers not installed)
    assert set(got) == set(rows.split(",")) - skipped
    assert all(r["rate"] > 0 and r["images"] == 64 and r["cpu_ms"] > 0 for r in got.values())
    assert "kpipe-packed-pil / kpipe-samples-pil:" in out and "(target >= 2.0x)" in out  # the same PIL code, two storages
    assert "best packed-256 path kpipe-packed-" in out
    if "kpipe-packed-sj" in skipped:
        assert "skipped jpeg/kpipe-packed-sj: simplejpeg is not installed" in out
    else:
        assert "kpipe-packed-sj / packed-sj-bare:" in out and "kpipe-packed-sj / kpipe-files-sj:" in out
    if "grain-packed" not in skipped:
        assert "kpipe-packed-pil / grain-packed:" in out
