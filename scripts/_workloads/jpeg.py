"""The jpeg workload: a folder of JPEG photos decoded to 224x224, batch 128 (issue #45).

The folder (`--jpeg-images`, default 1280, ~500x375 at quality 90, 10 classes) is made
from a photo a package ships (see jpeg_folder.py), packed twice with `kpipe pack` (original
bytes; re-encoded at max side 256). Each row runs in a fresh process and reports the best
epoch's images/s after one untimed epoch, and its process CPU time per image (which the
load of other processes on the machine disturbs less than the wall clock):

  keras-idf          keras.utils.image_dataset_from_directory(dir, image_size=(224, 224),
                     batch_size=128).prefetch(AUTOTUNE)                  decode + resize
  kpipe-files        kpipe.data.pipeline(from_files(dir, image_size=(224, 224)), 128)
  kpipe-packed       the same from from_packed(original bytes)
  kpipe-packed-256   the same from from_packed(max side 256)               smaller JPEGs
  tfdata-rrc         hand-written tf.data: sample_distorted_bounding_box + decode_and_crop_jpeg
                     + resize + random flip, map(AUTOTUNE)              random-resized crop
  kpipe-rrc          pipeline(from_files(dir, (224, 224), crop="random", flip=True, seed=0))
  kpipe-rrc-packed-256  the same from the max-side-256 pack
  pil-bare           the per-sample PIL decoder (draft mode, crop, resize, flip) in --workers
                     bare processes, each writing its share into its own array
  kpipe-samples-pil  ProcessLoader.from_samples over that PIL decoder
  torch, grain       PyTorch's DataLoader / Grain over the PIL decoder, where installed
  packed-pil-bare    kpipe.data.PackedImages(max side 256 pack, PIL draft decoding, random-resized
                     crop, flip) in --workers bare processes, each writing its share into its own array
  kpipe-packed-pil   ProcessLoader.from_samples over those PackedImages
  torch-packed       PyTorch's DataLoader(num_workers=--workers, persistent_workers=True) over them
  packed-cv2-bare, kpipe-packed-cv2, torch-packed-cv2  the same with decoder="cv2" (OpenCV's
                     IMREAD_REDUCED_COLOR_*; in from_samples each crop is resized straight into
                     the batch's row: PackedImages.kpipe_sample_into)
  packed-sj-bare, kpipe-packed-sj, torch-packed-sj  the same with decoder="simplejpeg"
                     (libjpeg-turbo; skipped where simplejpeg is not installed)
  grain-packed       Grain over PackedImages (PIL): MapDataset.source(images).shuffle(seed=0)
                     .repeat().batch(128).to_iter_dataset().mp_prefetch(num_workers=--workers),
                     one iterator for every epoch (its workers start once); timed over all its
                     timed epochs as one span (its workers run on across epoch ends)
  grain-loader-packed  the same through grain.DataLoader(data_source=images, sampler=
                     IndexSampler(shuffle=True, num_epochs=None, seed=0), operations=[Batch(128)],
                     worker_count=--workers), timed the same way
  kpipe-files-sj     ProcessLoader.from_samples over kpipe.data.FolderImages: PackedImages's code
                     (decoder="simplejpeg") reading each image from the folder's file instead of
                     the pack: the same loader and augmentation over the two storages

CPU ms/image is the CPU time of the row's process and all its children (live workers read
through psutil, joined ones through rusage) over the timed epoch, per image.

Open/list cost: listing the folder and opening+reading every file, against opening the
pack's shards (their index) and reading every image's bytes as PackedImages does (one
`os.pread` each), in this process (page cache warm).
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HELP = "JPEG photos decoded to 224x224 (decode+resize, random-resized crop, packed)"
SIZE = (224, 224)
BATCH = 128
ROWS = ("keras-idf", "kpipe-files", "kpipe-packed", "kpipe-packed-256", "tfdata-rrc", "kpipe-rrc", "kpipe-rrc-packed-256",
        "pil-bare", "kpipe-samples-pil", "torch", "grain", "packed-pil-bare", "kpipe-packed-pil", "torch-packed",
        "packed-cv2-bare", "kpipe-packed-cv2", "torch-packed-cv2", "packed-sj-bare", "kpipe-packed-sj", "torch-packed-sj",
        "grain-packed", "grain-loader-packed", "kpipe-files-sj")
_PEERS = {"torch": ("torch",), "grain": ("grain",), "torch-packed": ("torch",), "torch-packed-cv2": ("torch",),
          "packed-sj-bare": ("simplejpeg",), "kpipe-packed-sj": ("simplejpeg",), "torch-packed-sj": ("torch", "simplejpeg"),
          "grain-packed": ("grain",), "grain-loader-packed": ("grain",), "kpipe-files-sj": ("simplejpeg",)}
_SAMPLE_ROWS = ("pil-bare", "kpipe-samples-pil", "torch", "grain", "packed-pil-bare", "kpipe-packed-pil", "torch-packed",
                "packed-cv2-bare", "kpipe-packed-cv2", "torch-packed-cv2", "packed-sj-bare", "kpipe-packed-sj",
                "torch-packed-sj", "grain-packed", "grain-loader-packed", "kpipe-files-sj")


def add_arguments(parser):
    parser.add_argument("--jpeg-images", type=int, default=1280, help="images of the jpeg workload. Default: 1280")
    parser.add_argument("--jpeg-rows", default=",".join(ROWS), help=f"rows of the jpeg workload. Default: {','.join(ROWS)}")


# --- the per-sample PIL decoder (rows pil-bare, kpipe-samples-pil, torch, grain) --------------------------


class PilCrops:
    """Map-style records: `[j]` is file j's random-resized crop (scale 0.08-1, ratio 3/4-4/3,
    10 tries, else the whole image), decoded in PIL's draft mode (DCT-scaled to the smallest
    size still >= the crop's share of the output), resized to 224x224, flipped with p=1/2;
    the draws come from `(seed, epoch, j)`."""

    def __init__(self, paths, labels, seed=0):
        self.paths, self.labels, self.seed, self.epoch = list(paths), np.asarray(labels, np.int32), seed, 0

    def __len__(self):
        return len(self.paths)

    def on_epoch_end(self):
        self.epoch += 1

    def __getitem__(self, j):
        from PIL import Image

        rng = np.random.default_rng((self.seed, self.epoch, j))
        with Image.open(self.paths[j]) as im:
            w, h = im.size
            box = (0, 0, w, h)
            for _ in range(10):
                area = w * h * rng.uniform(0.08, 1.0)
                aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                cw, ch = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
                if 0 < cw <= w and 0 < ch <= h:
                    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                    box = (x, y, x + cw, y + ch)
                    break
            # draft: the largest DCT scale at which the crop still has >= 224 pixels a side
            scale = min((box[2] - box[0]) / SIZE[1], (box[3] - box[1]) / SIZE[0])
            im.draft("RGB", (int(w / max(1, scale)), int(h / max(1, scale))))
            f = im.size[0] / w
            im = im.convert("RGB").resize(SIZE[::-1], Image.BILINEAR, box=tuple(v * f for v in box))
        if rng.random() < 0.5:  # a flipped copy (PyTorch's collate refuses negative strides)
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(im), self.labels[j]


def folder_images(folder, decoder, flip=True):
    """`kpipe.data.FolderImages` over the folder: `PackedImages`' decoding of the folder's files, so a
    loader's rows over the folder and over the pack differ in the storage only (random-resized crop
    of the default scale and ratio)."""
    import kpipe.data

    return kpipe.data.FolderImages(folder, image_size=SIZE, crop="random", flip=flip, seed=0, decoder=decoder)


def _bare(records, workers, epochs):
    """Best images/s and least CPU ms/image of `workers` forked processes running `records[j]` over their shares."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    best, cpu_ms = 0.0, float("inf")
    for epoch in range(epochs + 1):
        c = _cpu()
        start = ctx.Barrier(workers + 1)

        def work(k):
            out = np.zeros((2,) + SIZE + (3,), np.uint8)  # two reused slots, as a loader's are
            start.wait()
            for i, j in enumerate(range(k, len(records), workers)):
                out[i % 2] = records[j][0]
        procs = [ctx.Process(target=work, args=(k,)) for k in range(workers)]
        for p in procs:
            p.start()
        start.wait()
        t = time.perf_counter()
        for p in procs:
            p.join(600)
        if epoch:
            best = max(best, len(records) / (time.perf_counter() - t))
            cpu_ms = min(cpu_ms, (_cpu() - c) / len(records) * 1e3)
        records.on_epoch_end()
    return best, cpu_ms


# --- one row, in its own process ---------------------------------------------------------------------------


def _cpu():
    """CPU seconds of this process, its joined children (rusage) and its live descendants (psutil)."""
    import psutil

    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # (ended meanwhile: rusage counts it once it is joined)
            continue
        total += t.user + t.system
    return total


def _files(folder):
    import kpipe.data
    from kpipe.data._files import _DEFAULT_EXTENSIONS, list_files

    _, paths, labels = list_files(folder, None, _DEFAULT_EXTENSIONS)
    return paths, labels


def reference_rrc(path, label):
    """The hand-written tf.data random-resized crop + flip users write (the Inception recipe:
    `sample_distorted_bounding_box`, `decode_and_crop_jpeg`, resize): the reference the fused
    crop is measured against, here and in bench_jpeg_steps.py."""
    import tensorflow as tf

    data = tf.io.read_file(path)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.image.extract_jpeg_shape(data), tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    image = tf.image.resize(tf.io.decode_and_crop_jpeg(data, tf.stack([y, x, h, w]), channels=3), SIZE)
    return tf.image.random_flip_left_right(image), label


def _dataset(row, ctx):
    import tensorflow as tf

    import kpipe.data

    folder, packed, packed256 = ctx["folder"], ctx["packed"], ctx["packed256"]
    if row == "keras-idf":
        import keras

        return keras.utils.image_dataset_from_directory(folder, image_size=SIZE, batch_size=BATCH, verbose=False).prefetch(tf.data.AUTOTUNE)
    if row == "kpipe-files":
        return kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=SIZE), batch_size=BATCH)
    if row in ("kpipe-packed", "kpipe-packed-256"):
        return kpipe.data.pipeline(kpipe.data.from_packed(packed if row == "kpipe-packed" else packed256, image_size=SIZE), batch_size=BATCH)
    if row == "kpipe-rrc":
        return kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=SIZE, crop="random", flip=True, seed=0), batch_size=BATCH)
    if row == "kpipe-rrc-packed-256":
        return kpipe.data.pipeline(kpipe.data.from_packed(packed256, image_size=SIZE, crop="random", flip=True, seed=0), batch_size=BATCH)
    if row == "tfdata-rrc":
        paths, labels = _files(folder)

        ds = tf.data.Dataset.from_tensor_slices((paths, labels)).map(reference_rrc, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)
    raise ValueError(row)


def _epochs(iterate, epochs, warm=None):
    """Best images/s and least CPU ms/image of `epochs` timed calls of `iterate` after one
    untimed (`warm[0]` is set True once the untimed one is done, where given)."""
    best, cpu_ms = 0.0, float("inf")
    for epoch in range(epochs + 1):
        if warm is not None and epoch:
            warm[0] = True
        t, c = time.perf_counter(), _cpu()
        n = iterate()
        rate, ms = n / (time.perf_counter() - t), (_cpu() - c) / max(1, n) * 1e3
        if epoch:
            best, cpu_ms = max(best, rate), min(cpu_ms, ms)
    return best, cpu_ms


def run_row(row, ctx):
    """Runs one row here; returns `{"rate": images/s, "cpu_ms": CPU ms per image}` (its workers' CPU included)."""
    epochs, workers = ctx["epochs"], ctx["workers"]
    if row in _SAMPLE_ROWS:
        decoder = "cv2" if "cv2" in row else "simplejpeg" if row.endswith("-sj") or "-sj-" in row else "pil"
        if "packed" in row:
            import kpipe.data

            records = kpipe.data.PackedImages(ctx["packed256"], image_size=SIZE, crop="random", flip=True, seed=0, decoder=decoder)
        elif row == "kpipe-files-sj":
            records = folder_images(ctx["folder"], decoder)
        else:
            paths, labels = _files(ctx["folder"])
            records = PilCrops(paths, labels)
        if row.endswith("bare"):
            rate, cpu_ms = _bare(records, workers, epochs)
            return {"rate": rate, "cpu_ms": cpu_ms}
        if row.startswith("kpipe-"):
            import kpipe

            with kpipe.ProcessLoader.from_samples(records, BATCH, shuffle=True, seed=0, workers=workers) as loader:
                def iterate():
                    n = sum(len(loader[i][1]) for i in range(len(loader)))
                    loader.on_epoch_end()
                    return n
                rate, cpu_ms = _epochs(iterate, epochs)
            return {"rate": rate, "cpu_ms": cpu_ms}
        if row.startswith("torch"):
            import torch.utils.data

            loader = torch.utils.data.DataLoader(records, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=True)
            rate, cpu_ms = _epochs(lambda: sum(len(y) for _, y in loader), epochs)
            return {"rate": rate, "cpu_ms": cpu_ms}
        import grain

        # one iterator over repeated epochs (its workers start once, as the others' persist)
        if row == "grain-loader-packed":
            sampler = grain.samplers.IndexSampler(num_records=len(records), shard_options=grain.sharding.NoSharding(),
                                                  shuffle=True, num_epochs=None, seed=0)
            it = iter(grain.DataLoader(data_source=records, sampler=sampler, operations=[grain.transforms.Batch(batch_size=BATCH)],
                                       worker_count=workers))
        else:
            ds = grain.MapDataset.source(records).shuffle(seed=0).repeat().batch(BATCH).to_iter_dataset()
            it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
        per_epoch = -(-len(records) // BATCH)
        # timed as one span of the timed epochs: its workers run ahead across epochs (one
        # batch each), which a best single epoch would count as free
        warm = [False]

        def span():
            return sum(len(next(it)[1]) for _ in range(per_epoch * (epochs if warm[0] else 1)))
        rate, cpu_ms = _epochs(span, 1, warm)
        return {"rate": rate, "cpu_ms": cpu_ms}
    ds = _dataset(row, ctx)
    rate, cpu_ms = _epochs(lambda: sum(int(y.shape[0]) for _, y in ds), epochs)
    return {"rate": rate, "cpu_ms": cpu_ms}


# --- the parent: data, rows in fresh processes, table ------------------------------------------------------


def _open_costs(folder, shards):
    """Seconds to list the folder and read every file, and to open every shard (its index)
    and read every image's bytes as PackedImages does (one os.pread each)."""
    import kpipe.data

    t = time.perf_counter()
    paths, _ = _files(folder)
    listed = time.perf_counter() - t
    for p in paths:
        with open(p, "rb") as f:
            f.read()
    files_s = time.perf_counter() - t
    t = time.perf_counter()
    images = kpipe.data.PackedImages(shards)
    for j in range(len(images)):
        images.read(j)
    return listed, files_s, time.perf_counter() - t


def peer_missing(row):
    import importlib.util

    for package in _PEERS.get(row, ()):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (pip install {package}{'-jax' if package == 'grain' else ''})"
    return None


def run(args, workers, repeats, quick):
    """Runs the jpeg workload's rows, each in a fresh process, `repeats` rounds; returns the rows."""
    import kpipe.data
    from _workloads.jpeg_folder import make_folder

    rows = [r.strip() for r in args.jpeg_rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--jpeg-rows takes a comma-separated subset of {','.join(ROWS)}. Received unknown: {','.join(unknown)}")
    skipped = {r: why for r in rows if (why := peer_missing(r))}
    for r, why in skipped.items():
        print(f"skipped jpeg/{r}: {why}", flush=True)
    rows = [r for r in rows if r not in skipped]
    n = 64 if quick else args.jpeg_images
    epochs = 1 if quick else 3
    out = []
    with tempfile.TemporaryDirectory(prefix="kpipe-jpeg-") as tmp:
        folder = os.path.join(tmp, "photos")
        photo = make_folder(folder, n)
        packed = kpipe.data.pack(folder, os.path.join(tmp, "packed", "orig"), verbose=False)["shards"]
        t = time.perf_counter()
        packed256 = kpipe.data.pack(folder, os.path.join(tmp, "packed", "s256"), max_side=256, verbose=False)["shards"]
        pack_s = time.perf_counter() - t
        mb = lambda paths: sum(os.path.getsize(p) for p in paths) / 1e6  # noqa: E731
        listed, files_s, shards_s = _open_costs(folder, packed)
        print(f"\njpeg workload: {n} JPEGs from {photo}, {mb(_files(folder)[0]):.0f} MB; packed {mb(packed):.0f} MB in "
              f"{len(packed)} shards, at max side 256 {mb(packed256):.0f} MB (packing took {pack_s:.1f} s)\n"
              f"open/list (page cache warm): list the folder {listed * 1e3:.0f} ms, list + open + read every file "
              f"{files_s * 1e3:.0f} ms; open the shards and read every image {shards_s * 1e3:.0f} ms "
              f"({files_s / max(shards_s, 1e-9):.1f}x)", flush=True)
        ctx = {"folder": folder, "packed": packed, "packed256": packed256, "epochs": epochs, "workers": workers}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                                          env.get("PYTHONPATH")]))
        best = {}
        for round_ in range(repeats):
            for row in rows:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), row, json.dumps(ctx)], capture_output=True,
                                      text=True, timeout=900, env=env)
                line = next((l for l in proc.stdout.splitlines() if l.startswith("ROW ")), None)
                if proc.returncode or line is None:
                    raise RuntimeError(f"jpeg/{row} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                got = json.loads(line[4:])
                print(f"  round {round_ + 1} jpeg/{row}: {got['rate']:.0f} images/s"
                      + (f", {got['cpu_ms']:.2f} CPU ms/image" if got["cpu_ms"] else ""), flush=True)
                had = best.setdefault(row, {"rate": 0.0, "cpu_ms": None, "rounds": []})
                had["rounds"].append(got["rate"])
                had["rate"] = max(had["rate"], got["rate"])
                if got["cpu_ms"] is not None:
                    had["cpu_ms"] = got["cpu_ms"] if had["cpu_ms"] is None else min(had["cpu_ms"], got["cpu_ms"])
        for row in rows:
            out.append({"workload": "jpeg", "loader": row, "rate": best[row]["rate"], "cpu_ms": best[row]["cpu_ms"],
                        "round_rates": best[row]["rounds"],
                        "images": n, "photo": photo, "open_list_s": {"list": listed, "files": files_s, "shards": shards_s}})
    return out, skipped


_RATIOS = (  # (row, of row, the target)
    ("kpipe-files", "keras-idf", 1.0),
    ("kpipe-rrc", "tfdata-rrc", 1.0),
    ("kpipe-packed-256", "kpipe-files", 2.0),
    ("kpipe-packed", "kpipe-files", None),
    ("kpipe-samples-pil", "pil-bare", 0.95),
    ("kpipe-samples-pil", "torch", 1.2),
    ("kpipe-packed-pil", "packed-pil-bare", 0.95),
    ("kpipe-packed-pil", "torch-packed", 1.2),
    ("kpipe-packed-cv2", "packed-cv2-bare", 0.95),
    ("kpipe-packed-cv2", "torch-packed-cv2", 1.2),
    ("kpipe-packed-cv2", "kpipe-packed-pil", None),
    ("kpipe-packed-sj", "packed-sj-bare", 0.95),
    ("kpipe-packed-sj", "torch-packed-sj", 1.2),
    ("kpipe-packed-sj", "kpipe-packed-pil", None),
    ("kpipe-packed-sj", "kpipe-packed-cv2", None),
    ("kpipe-packed-pil", "grain-packed", None),
    ("kpipe-packed-pil", "grain-loader-packed", None),
    # packed at max side 256 against the folder: the same loader and augmentation, two storages
    ("kpipe-rrc-packed-256", "kpipe-rrc", 2.0),
    ("kpipe-packed-pil", "kpipe-samples-pil", 2.0),
    ("kpipe-packed-sj", "kpipe-files-sj", 2.0),
)
# the random-resized-crop rows over the folder and over the max-side-256 pack: the best of each
_FOLDER_RRC = ("tfdata-rrc", "kpipe-rrc", "kpipe-samples-pil", "torch", "grain", "kpipe-files-sj")
_PACKED_RRC = ("kpipe-rrc-packed-256", "kpipe-packed-pil", "kpipe-packed-cv2", "kpipe-packed-sj")


def _paired(row, of):
    """The median over rounds of `row`'s images/s / `of`'s in the same round (the machine's
    load moves between rounds more than between two rows of one round), or None."""
    a, b = row.get("round_rates") or [], of.get("round_rates") or []
    return float(np.median([x / y for x, y in zip(a, b)])) if a and len(a) == len(b) else None


def print_rows(rows, workers, repeats):
    """Prints the jpeg rows and their ratios (wall-clock images/s; CPU ms/image, workers included)."""
    import _bench

    by = {r["loader"]: r for r in rows if r["workload"] == "jpeg"}
    if not by:
        return
    print(f"\njpeg workload: 224x224 output, batch {BATCH}, workers {workers}, best of {repeats} rounds of 3 epochs "
          "after 1 untimed, each row in a fresh process (paired: median over rounds of the ratio within a round)")
    _bench.print_table((("loader", "<22", ""), ("images/s", ">10", ".0f"), ("CPU ms/image", ">14", ".2f")),
                       [(k, r["rate"], r["cpu_ms"]) for k, r in by.items()])
    for row, of, target in _RATIOS:
        if row in by and of in by:
            ratio = by[row]["rate"] / by[of]["rate"]
            cpu = (by[of]["cpu_ms"] / by[row]["cpu_ms"]) if by[row]["cpu_ms"] and by[of]["cpu_ms"] else None
            verdict = "" if target is None else (" PASS" if ratio >= target else " MISS") + f" (target >= {target}x)"
            paired = _paired(by[row], by[of])
            print(f"  {row} / {of}: {ratio:.2f}x images/s" + (f" (paired {paired:.2f}x)" if paired else "")
                  + (f", {cpu:.2f}x by CPU time per image" if cpu else "") + verdict)
    folder = max((r for r in _FOLDER_RRC if r in by), key=lambda r: by[r]["rate"], default=None)
    packed = max((r for r in _PACKED_RRC if r in by), key=lambda r: by[r]["rate"], default=None)
    if folder and packed:
        print(f"  best packed-256 path {packed} / best folder path {folder} (random-resized crop + flip): "
              f"{by[packed]['rate'] / by[folder]['rate']:.2f}x images/s"
              + (f", {by[folder]['cpu_ms'] / by[packed]['cpu_ms']:.2f}x by CPU time per image"
                 if by[packed]["cpu_ms"] and by[folder]["cpu_ms"] else ""))


def main_child():
    ctx = json.loads(sys.argv[2])
    print("ROW " + json.dumps(run_row(sys.argv[1], ctx)), flush=True)
    os._exit(0)  # no TensorFlow teardown


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main_child()
