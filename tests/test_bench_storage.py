"""Smoke test of scripts/bench_storage.py: every row reads what it should (the pack's bytes
equal the folder's files), loaders see every image, and the loopback sshfs mount and its sshd
are gone afterwards (no timing assertions)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_storage.py")


def _run(tmp_path, *args, timeout=280):
    out = tmp_path / "storage.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--small", "--json", str(out), *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _check_io(result, storages):
    rows = {(r["storage"], r["row"], r["threads"]): r for r in result["io"]}
    assert set(rows) == {(s, row, t) for s in storages for row, t in
                         [("list", 1), ("files", 1), ("files", 8), ("pack", 1), ("pack", 8)]}
    for s in storages:
        files = rows[(s, "files", 1)]["bytes"]
        assert files > 64 * 1000  # 64 JPEGs of ~500x375
        # `pack` keeps a JPEG's bytes: every image once, in any order, whatever the thread count
        assert rows[(s, "files", 8)]["bytes"] == rows[(s, "pack", 1)]["bytes"] == rows[(s, "pack", 8)]["bytes"] == files
        assert all(len(r["seconds"]) == 1 and r["seconds"][0] >= 0 for r in rows.values())


@pytest.mark.timeout(300)
def test_bench_storage_io_rows_read_every_image_once(tmp_path):
    result, stdout = _run(tmp_path, "--no-loaders", "--root", str(tmp_path))
    _check_io(result, [f"--root {tmp_path}"])
    assert result["loaders"] == [] and "vs files" in stdout
    assert [p.name for p in tmp_path.iterdir()] == ["storage.json"]  # the data it wrote under --root are removed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_storage_loaders_see_every_image(tmp_path):
    result, stdout = _run(tmp_path, timeout=380)
    assert {r["row"] for r in result["loaders"]} == {"keras-idf", "kpipe-files", "kpipe-packed", "kpipe-packed256"}
    assert all(r["rates"][0] > 0 and r["cpu_ms"][0] > 0 for r in result["loaders"])  # (a pass short of 64 images raises)
    assert "vs keras-idf" in stdout


def _mounts():
    with open("/proc/mounts") as f:
        return [line for line in f if "kpipe-sshfs-" in line]


def _sshds():
    return subprocess.run(["pgrep", "-f", "kpipe-sshfs-"], capture_output=True, text=True).stdout.split()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not (os.path.exists("/usr/sbin/sshd") and shutil.which("sshfs") and os.path.exists("/dev/fuse")),
                    reason="needs sshd, sshfs and FUSE (Debian: openssh-server, sshfs)")
def test_bench_storage_over_sshfs_leaves_no_mount_or_server(tmp_path):
    before = (_mounts(), _sshds())
    result, _ = _run(tmp_path, "--no-loaders", "--sshfs")
    _check_io(result, ["local", "sshfs"])
    assert (_mounts(), _sshds()) == before == ([], [])


def test_bench_storage_refuses_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rounds" in proc.stderr and "got" in proc.stderr
    proc = subprocess.run([sys.executable, SCRIPT, "--root", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope" in proc.stderr
