#!/usr/bin/env python3
"""An image folder against its pack, on the storage they live on: listing and opening cost,
and images/s of the loaders (issue 45, part 4: "network storage lists and opens files slowly").

The folder is the jpeg workload's (`scripts/_workloads/jpeg_folder.py`: `--images` JPEGs of
~500x375 px, crops of a photo a package ships, one sub-folder per class); it is packed with
`kpipe.data.pack` at the original size and at max side 256. Then, on each storage:

  I/O alone, in this process, every image once in a shuffled order (seed 0), `--threads`
  threads reading at once (1: a serial loop):
    list        list the folder's class sub-folders (`from_files`' listing)
    files       list, then open + read + close every file
    pack        read the shards' index (labels, offsets), then one `os.pread` per image
                (`PackedImages`' read)
  Loaders, one pass each, timed from building the pipeline (the listing included) to its
  last batch (batch 128, 224x224 output, decode + resize: the work Keras's function does):
    keras-idf        keras.utils.image_dataset_from_directory(folder).prefetch(AUTOTUNE)
    kpipe-files      kpipe.data.pipeline(kpipe.data.from_files(folder), ...)
    kpipe-packed     kpipe.data.pipeline(kpipe.data.from_packed(shards), ...)
    kpipe-packed256  the same over the pack at max side 256

Storages:
  local   the temporary folder (its page cache warm: what a second epoch on a local disk sees)
  sshfs   (`--sshfs`) the same folder mounted over SFTP from an sshd on 127.0.0.1 (a network
          filesystem's round trips per open, stat and read over a real TCP connection, without a
          network's latency: a lower bound of what NFS/SMB/FUSE object stores cost). Mounted
          afresh before every measurement, so the client's caches are cold and the server's
          page cache warm. Needs `sshd` and `sshfs` (Debian: openssh-server, sshfs) and FUSE.
  --root DIR   a folder on a storage of your own (an NFS mount, say): the data are written
               there, measured there, and removed.

Each measurement runs `--rounds` times, rows interleaved; the best round counts (median
beside it). "vs files"/"vs keras-idf" are ratios measured in the same run.

    python scripts/bench_storage.py                     # local only
    python scripts/bench_storage.py --sshfs --rounds 3  # local and a loopback sshfs mount
    python scripts/bench_storage.py --root /mnt/nfs/tmp # your own storage
    python scripts/bench_storage.py --small             # a smoke test, not a measurement
"""

import argparse
import concurrent.futures
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
from _workloads.jpeg_folder import make_folder  # noqa: E402

IO_ROWS = ("list", "files", "pack")
LOADER_ROWS = ("keras-idf", "kpipe-files", "kpipe-packed", "kpipe-packed256")


def _shuffled(n):
    import numpy as np

    return np.random.default_rng(0).permutation(n)


def io_row(row, folder, shards, threads):
    """`(seconds, bytes read)` of one I/O measurement (see the module docstring)."""
    from kpipe.data._files import _DEFAULT_EXTENSIONS, list_files
    from kpipe.data._packed_images import _open_shard, read_index

    t = time.perf_counter()
    if row in ("list", "files"):
        _, paths, _ = list_files(folder, None, _DEFAULT_EXTENSIONS)
        if row == "list":
            return time.perf_counter() - t, 0

        def read(i):
            with open(paths[i], "rb") as f:
                return len(f.read())

        order = _shuffled(len(paths))
    else:
        _, _, offsets = read_index(shards)
        where = [_open_shard(path) for path in shards]  # (fd, offset, h5py dataset): PackedImages' read
        if any(fd is None for fd, _, _ in where):
            raise RuntimeError(f"{shards}: not stored contiguous (written by an older `pack`?)")
        spans = [(k, int(o[i]), int(o[i + 1])) for k, o in enumerate(offsets) for i in range(len(o) - 1)]

        def read(i):
            k, a, b = spans[i]
            fd, base, _ = where[k]
            return len(os.pread(fd, b - a, base + a))

        order = _shuffled(len(spans))
    try:
        if threads == 1:
            total = sum(read(i) for i in order)
        else:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(read, order))
    finally:
        if row == "pack":
            for fd, _, data in where:
                os.close(fd)
                data.file.close()
    if not total:
        raise RuntimeError(f"{row}: read no bytes")
    return time.perf_counter() - t, total


def loader_row(row, folder, shards, shards256, n):
    """`(images/s, CPU ms/image)` of one pass of `row`, timed from building its pipeline."""
    import tensorflow as tf

    import keras
    import kpipe.data

    c, t = time.process_time(), time.perf_counter()
    if row == "keras-idf":
        ds = keras.utils.image_dataset_from_directory(folder, image_size=(224, 224), batch_size=128, seed=0,
                                                      verbose=False).prefetch(tf.data.AUTOTUNE)
    elif row == "kpipe-files":
        ds = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(224, 224)), batch_size=128, shuffle=True, seed=0)
    else:
        paths = shards if row == "kpipe-packed" else shards256
        ds = kpipe.data.pipeline(kpipe.data.from_packed(paths, image_size=(224, 224)), batch_size=128, shuffle=True, seed=0)
    seen = sum(int(x.shape[0]) for x, _ in ds)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    del ds  # (its open files: before the storage is unmounted)
    gc.collect()
    if seen != n:
        raise RuntimeError(f"{row}: one pass gave {seen} images, not {n}")
    return n / dt, dc / n * 1e3


# --- the loopback sshfs mount ------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sshfs:
    """An sshd on 127.0.0.1 (keys and config of its own in a temporary folder) serving
    `source`, and `mount()` / `unmount()` of it at a mount point, over SFTP."""

    def __init__(self, source):
        missing = [p for p in ("/usr/sbin/sshd", shutil.which("sshfs"), shutil.which("fusermount")) if not p or not os.path.exists(p)]
        if missing or not os.path.exists("/dev/fuse"):
            raise RuntimeError("--sshfs needs sshd, sshfs, fusermount and /dev/fuse (Debian: apt-get install openssh-server "
                               "sshfs); leave --sshfs out, or measure your own storage with --root")
        self.source = source
        self.dir = tempfile.mkdtemp(prefix="kpipe-sshfs-")
        self.point = os.path.join(self.dir, "mnt")
        os.mkdir(self.point)
        self.proc = None
        self.mounted = False
        for key in ("host", "client"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.dir, key)], check=True)
        shutil.copy(os.path.join(self.dir, "client.pub"), os.path.join(self.dir, "authorized_keys"))
        self.port = _free_port()
        with open(os.path.join(self.dir, "sshd_config"), "w") as f:
            f.write(f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.dir}/host\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nPasswordAuthentication no\n"
                    "PermitRootLogin prohibit-password\nStrictModes no\nSubsystem sftp internal-sftp\n"
                    f"PidFile {self.dir}/sshd.pid\n")
        os.makedirs("/run/sshd", exist_ok=True)  # (sshd's privilege-separation folder)
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", os.path.join(self.dir, "sshd_config"),
                                      "-E", os.path.join(self.dir, "sshd.log")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"sshd did not start on 127.0.0.1:{self.port} (see {self.dir}/sshd.log)")
            time.sleep(0.1)

    def mount(self):
        """Mounts the source afresh (the client's caches empty); returns the mount point."""
        self.unmount()
        subprocess.run(["sshfs", "-p", str(self.port), "-o",
                        f"IdentityFile={self.dir}/client,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,LogLevel=ERROR",
                        f"root@127.0.0.1:{self.source}", self.point], check=True, timeout=30,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # (its daemon keeps no pipe of ours)
        self.mounted = True
        return self.point

    def unmount(self):
        if self.mounted:
            done = subprocess.run(["fusermount", "-u", self.point], capture_output=True, text=True, timeout=30)
            if done.returncode:  # still in use (a file left open): detach it now, freed when closed
                subprocess.run(["fusermount", "-u", "-z", self.point], capture_output=True, timeout=30, check=True)
            self.mounted = False

    def close(self):
        self.unmount()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- the run -----------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1280, help="JPEGs in the folder (default 1280)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, rows interleaved; the best counts (default 3)")
    parser.add_argument("--threads", type=int, default=8, help="threads reading at once in the I/O rows, besides 1 (default 8)")
    parser.add_argument("--sshfs", action="store_true", help="also measure over a loopback sshfs mount")
    parser.add_argument("--root", help="write and measure the data in this folder instead of a temporary one")
    parser.add_argument("--no-loaders", action="store_true", help="the I/O rows only (no TensorFlow)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--small", action="store_true", help="64 images, 1 round: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    if args.images < 1 or args.rounds < 1 or args.threads < 1:
        parser.error(f"--images, --rounds and --threads must be >= 1, got {args.images}, {args.rounds}, {args.threads}")
    if args.root is not None and not os.path.isdir(args.root):
        parser.error(f"--root {args.root!r} is not an existing folder")
    n, rounds = (64, 1) if args.small else (args.images, args.rounds)

    import kpipe.data

    base = tempfile.mkdtemp(prefix="kpipe-storage-", dir=args.root)
    mount = None
    try:
        folder = os.path.join(base, "photos")
        photo = make_folder(folder, n)
        packed = [os.path.relpath(p, base) for p in kpipe.data.pack(folder, os.path.join(base, "packed", "orig"), verbose=False)["shards"]]
        packed256 = [os.path.relpath(p, base) for p in kpipe.data.pack(folder, os.path.join(base, "packed", "s256"), max_side=256,
                                                                        verbose=False)["shards"]]
        size = lambda rel: sum(os.path.getsize(os.path.join(base, p)) for p in rel) / 1e6  # noqa: E731
        files_mb = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs) / 1e6
        print(f"{n} JPEGs from {photo}: {files_mb:.0f} MB in {n} files; packed {size(packed):.0f} MB in {len(packed)} shards, "
              f"at max side 256 {size(packed256):.0f} MB in {len(packed256)}", flush=True)
        storages = [("local" if args.root is None else f"--root {args.root}", None)]
        if args.sshfs:
            mount = Sshfs(base)
            storages.append(("sshfs", mount))
        io_rows = [(r, t) for r in IO_ROWS for t in ((1,) if r == "list" else sorted({1, args.threads}))]
        loader_rows = () if args.no_loaders else LOADER_ROWS
        if loader_rows:  # (TensorFlow's start-up and the first graph builds: not in the first row's figure)
            for row in loader_rows:
                loader_row(row, folder, [os.path.join(base, p) for p in packed], [os.path.join(base, p) for p in packed256], n)
        got, read = {}, {}
        for round_ in range(rounds):
            for storage, m in storages:
                for row, threads in io_rows + [(r, None) for r in loader_rows]:
                    where = m.mount() if m is not None else base
                    at = lambda rel: [os.path.join(where, p) for p in rel]  # noqa: E731
                    if threads is None:
                        value = loader_row(row, os.path.join(where, "photos"), at(packed), at(packed256), n)
                    else:
                        value, read[(storage, row, threads)] = io_row(row, os.path.join(where, "photos"), at(packed), threads)
                    got.setdefault((storage, row, threads), []).append(value)
            print(f"  round {round_ + 1} of {rounds} done", flush=True)
        print(f"\nI/O, every image once in a shuffled order; best of {rounds} rounds (median), ms; "
              "'vs files': files' time over this row's, same storage and threads:")
        table, result = [], {"images": n, "rounds": rounds, "io": [], "loaders": []}
        for storage, _ in storages:
            for row, threads in io_rows:
                result["io"].append({"storage": storage, "row": row, "threads": threads, "seconds": got[(storage, row, threads)],
                                     "bytes": read[(storage, row, threads)]})
                times = got[(storage, row, threads)]
                files = min(got[(storage, "files", threads)]) if row == "pack" else None
                table.append([storage, row, threads, f"{min(times) * 1e3:.0f}", f"{statistics.median(times) * 1e3:.0f}",
                              f"{min(times) / n * 1e6:.0f}" if row != "list" else "",
                              f"{files / min(times):.2f}" if files else ""])
        _bench.print_table([("storage", "<26", ""), ("read", "<7", ""), ("threads", ">8", ""), ("best ms", ">9", ""),
                            ("median ms", ">11", ""), ("us/image", ">10", ""), ("vs files", ">10", "")], table)
        if loader_rows:
            print(f"\nLoaders, one pass from building the pipeline (batch 128, 224x224, decode + resize); best of {rounds} "
                  "rounds (median); CPU ms/image of this process, least of the rounds:")
            table = []
            for storage, _ in storages:
                keras_rate = max(r for r, _ in got[(storage, "keras-idf", None)])
                files_rate = max(r for r, _ in got[(storage, "kpipe-files", None)])
                for row in loader_rows:
                    rates = [r for r, _ in got[(storage, row, None)]]
                    result["loaders"].append({"storage": storage, "row": row, "rates": rates,
                                              "cpu_ms": [c for _, c in got[(storage, row, None)]]})
                    table.append([storage, row, f"{max(rates):.0f}", f"{statistics.median(rates):.0f}",
                                  f"{min(c for _, c in got[(storage, row, None)]):.2f}",
                                  f"{max(rates) / keras_rate:.2f}", f"{max(rates) / files_rate:.2f}"])
            _bench.print_table([("storage", "<26", ""), ("loader", "<17", ""), ("images/s", ">9", ""), ("median", ">8", ""),
                                ("CPU ms/image", ">14", ""), ("vs keras-idf", ">14", ""), ("vs kpipe-files", ">16", "")], table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        print(f"\n(load average at the end: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs)")
    finally:
        if mount is not None:
            mount.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
