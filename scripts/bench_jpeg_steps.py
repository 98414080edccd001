#!/usr/bin/env python3
"""Where the CPU of kpipe's JPEG decoding goes: each step of `from_files` added one at a time
(issue #45), all in one process, in interleaved rounds, on the jpeg workload's folder.

Decode + resize (224x224, batch 128), against Keras's `image_dataset_from_directory`:
  keras          keras.utils.image_dataset_from_directory(dir, shuffle=False)
  map            from_tensor_slices(paths).map(read + decode_image + resize, AUTOTUNE).batch
  map+ignore     the same + ignore_errors() (what naming a failed file starts with)
  source         kpipe.data.from_files(dir).batch: map + ignore_errors + concatenate + take; the
                 pass that names a failed file is read only after a failure (_decoded.py's NOTE)
  source-skip    from_files(dir, on_error="skip").batch: + the position check on every sample
  pipeline       kpipe.data.pipeline(from_files(dir), batch_size=128): + options, parallel batch
Random-resized crop + flip, against the hand-written tf.data reference:
  ref-rrc        sample_distorted_bounding_box + decode_and_crop_jpeg + resize + random flip
  decoder-rrc    kpipe's fused decoder (JPEG-or-not cond, DCT-scale switch, stateless draws)
                 in a plain map: the decoder's own cost
  source-rrc     from_files(dir, crop="random", flip=True, seed=0).batch
  pipeline-rrc   pipeline(that, batch_size=128)
Packed at max side 256 against the folder (issue #45's 2x target), the same tf.data loader:
  files-decode   from_files(dir, image_size=None), each image's shape only: list, read, decode
  packed-decode  from_packed(max side 256 pack, image_size=None), the same: block reads, decode
  packed-source  from_packed(that, image_size=(224, 224)).batch: + resize to float32, batch
  packed-pipeline  pipeline(that, batch_size=128)   (against source / pipeline above)
Per sample, in Python (`--per-sample`; the code of kpipe.data.PackedImages, in this process,
no loader): CPU ms per image of each step added in turn, over the folder's files (~500x375)
and over the max-side-256 pack, for each decoder (pil, cv2, simplejpeg where installed):
  read           the encoded bytes: open + read of the file / one os.pread from the shard
  +window        + the crop's draws from (seed, epoch, j) and the header's size
  +decode        + decoding at the DCT scale the crop allows (1/2..1/8 when >= 2x the output)
  +resize        + the crop resized to 224x224 into a reused row (kpipe_sample_into, no flip)
  +flip          + the flip: kpipe_sample_into as from_samples runs it
  whole decode   decoding the whole image at full scale (the bound: what the storage costs)
Batching and the hand-over to the trainer are the loader's: bench_loaders.py's bare rows
(the same code in forked processes) against its kpipe rows give them.

Method: one untimed pass of each, then `--rounds` rounds over all of them in turn; per step
the least CPU time per image (this process's user + system time; the other jobs on a shared
machine disturb it less than the wall clock) and the best images/s. Ratios are against the
first row of each group.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZE, BATCH = (224, 224), 128


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def steps(folder, packed256=None):
    """Returns `{name: dataset}` of every step, in the order the docstring lists them."""
    import keras
    import tensorflow as tf

    import kpipe.data
    from _workloads.jpeg import reference_rrc
    from kpipe.data._source import source_of

    auto = tf.data.AUTOTUNE
    plain, _ = source_of(kpipe.data.from_files(folder, image_size=SIZE))
    rrc_source, _ = source_of(kpipe.data.from_files(folder, image_size=SIZE, crop="random", flip=True, seed=0))
    paths, labels = tf.constant(plain.paths.astype(str).tolist()), tf.constant(plain.label_array)

    def slices():
        return tf.data.Dataset.from_tensor_slices((paths, labels))

    def decode_resize(p, label):
        return tf.image.resize(tf.io.decode_image(tf.io.read_file(p), channels=3, expand_animations=False), SIZE), label

    def decoder_rrc(j, element):
        p, label = element
        return rrc_source.decoder(tf.io.read_file(p), tf.stack([tf.constant(0, tf.int64), j])), label

    def shape_only(ds):
        return ds.map(lambda x, y: (tf.shape(x), y), num_parallel_calls=auto).batch(BATCH)

    storage = {} if packed256 is None else {
        "files-decode": shape_only(kpipe.data.from_files(folder, image_size=None)),
        "packed-decode": shape_only(kpipe.data.from_packed(packed256, image_size=None)),
        "packed-source": kpipe.data.from_packed(packed256, image_size=SIZE).batch(BATCH),
        "packed-pipeline": kpipe.data.pipeline(kpipe.data.from_packed(packed256, image_size=SIZE), batch_size=BATCH),
    }
    return {
        "keras": keras.utils.image_dataset_from_directory(folder, image_size=SIZE, batch_size=BATCH, shuffle=False, verbose=False),
        "map": slices().map(decode_resize, num_parallel_calls=auto).batch(BATCH),
        "map+ignore": slices().map(decode_resize, num_parallel_calls=auto).ignore_errors().batch(BATCH),
        "source": kpipe.data.from_files(folder, image_size=SIZE).batch(BATCH),
        "source-skip": kpipe.data.from_files(folder, image_size=SIZE, on_error="skip").batch(BATCH),
        "pipeline": kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=SIZE), batch_size=BATCH),
        "ref-rrc": slices().map(reference_rrc, num_parallel_calls=auto).batch(BATCH),
        "decoder-rrc": slices().enumerate().map(decoder_rrc, num_parallel_calls=auto).batch(BATCH),
        "source-rrc": kpipe.data.from_files(folder, image_size=SIZE, crop="random", flip=True, seed=0).batch(BATCH),
        "pipeline-rrc": kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=SIZE, crop="random", flip=True, seed=0),
                                            batch_size=BATCH),
        **storage,
    }


def measure(datasets, rounds):
    """Returns `{name: {"cpu_ms": least CPU ms per image, "rate": best images/s}}`."""
    import tensorflow as tf

    datasets = {k: ds.prefetch(tf.data.AUTOTUNE) for k, ds in datasets.items()}
    out = {k: {"cpu_ms": float("inf"), "rate": 0.0} for k in datasets}
    for r in range(rounds + 1):
        for name, ds in datasets.items():
            t, c, n = time.perf_counter(), _cpu(), 0
            for _, y in ds:
                n += int(y.shape[0])
            if r:  # round 0 is the untimed warm-up
                out[name]["cpu_ms"] = min(out[name]["cpu_ms"], (_cpu() - c) / n * 1e3)
                out[name]["rate"] = max(out[name]["rate"], n / (time.perf_counter() - t))
    return out


def sample_steps(folder, packed256, rounds, n):
    """Returns `{decoder: {storage: {step: least CPU ms per image}}}` of the per-sample steps."""
    import importlib.util

    import numpy as np

    import kpipe.data
    from _workloads.jpeg import folder_images
    from kpipe.data._packed_images import _DCT_RATIOS, jpeg_size

    decoders = ["pil", "cv2"] + (["simplejpeg"] if importlib.util.find_spec("simplejpeg") else [])
    out = {}
    for decoder in decoders:
        stores = {"folder": lambda **kw: folder_images(folder, decoder, **kw),
                  "packed-256": lambda **kw: kpipe.data.PackedImages(packed256, image_size=SIZE, crop="random", seed=0,
                                                                     decoder=decoder, **kw)}
        for store, make in stores.items():
            plain, flipped = make(flip=False), make(flip=True)
            row = np.empty(SIZE + (3,), np.uint8), np.empty((), np.int32)

            def window(j, images=plain):
                data = images.read(j)
                rng = np.random.default_rng((images.seed, images.epoch, j))
                size = jpeg_size(data)
                return data, images.window(size[0], size[1], rng), size

            def decode(j, images=plain):
                data, (x, y, w, h), size = window(j, images)
                r = next((r for r in _DCT_RATIOS if w >= r * SIZE[1] and h >= r * SIZE[0]), 1)
                return _decode_at(decoder, data, size, r)

            got = {"read": plain.read, "+window": window, "+decode": decode,
                   "+resize": lambda j: plain.kpipe_sample_into(j, row), "+flip": lambda j: flipped.kpipe_sample_into(j, row),
                   "whole decode": lambda j: _decode_at(decoder, plain.read(j), None, 1)}
            best = {k: float("inf") for k in got}
            for _ in range(rounds):
                for step, f in got.items():
                    c = _cpu()
                    for j in range(n):
                        f(j)
                    best[step] = min(best[step], (_cpu() - c) / n * 1e3)
            out.setdefault(decoder, {})[store] = best
    return out


def _decode_at(decoder, data, size, r):
    """Decodes `data` at 1/r scale with `decoder` (PIL: draft mode), as PackedImages does."""
    import io

    import numpy as np

    if decoder == "pil":
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            if r > 1:
                im.draft("RGB", (im.size[0] // r, im.size[1] // r))
            return np.asarray(im.convert("RGB"))
    if decoder == "simplejpeg":
        from kpipe.data._packed_images import _decode_simplejpeg, jpeg_size

        return _decode_simplejpeg(data, size or jpeg_size(data), r)[0]
    import cv2

    from kpipe.data._packed_images import _cv2_flags

    return cv2.imdecode(np.frombuffer(data, np.uint8), _cv2_flags(cv2, r)[0])


def print_sample_steps(got):
    print("\nper sample, in Python (PackedImages's code, one process): CPU ms per image, cumulative steps")
    print(f"{'decoder':<12}{'step':<14}{'folder':>9}{'packed-256':>12}{'folder/packed':>15}")
    for decoder, stores in got.items():
        for step in stores["folder"]:
            a, b = stores["folder"][step], stores["packed-256"][step]
            print(f"{decoder:<12}{step:<14}{a:>9.3f}{b:>12.3f}{a / b:>14.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1280, help="JPEGs in the folder. Default: 1280")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds over all steps. Default: 3")
    parser.add_argument("--quick", action="store_true", help="64 images, 1 round (a smoke run)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--per-sample", action="store_true", help="also the per-sample steps (PackedImages's code)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from _workloads.jpeg_folder import make_folder

    n, rounds = (64, 1) if args.quick else (args.images, args.rounds)
    import kpipe.data

    with tempfile.TemporaryDirectory(prefix="kpipe-jpeg-steps-") as tmp:
        folder = os.path.join(tmp, "photos")
        photo = make_folder(folder, n)
        packed256 = kpipe.data.pack(folder, os.path.join(tmp, "packed", "s256"), max_side=256, verbose=False)["shards"]
        per_sample = sample_steps(folder, packed256, rounds, n) if args.per_sample else None
        got = measure(steps(folder, packed256), rounds)
    print(f"{n} JPEGs (~500x375, from {photo}) to 224x224, batch {BATCH}, one process, {rounds} interleaved rounds "
          f"after 1 untimed; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'step':<14}{'CPU ms/image':>14}{'x first':>9}{'images/s':>10}")
    for group in (("keras", "map", "map+ignore", "source", "source-skip", "pipeline"), ("ref-rrc", "decoder-rrc", "source-rrc", "pipeline-rrc"),
                  ("files-decode", "packed-decode"), ("source", "packed-source"), ("pipeline", "packed-pipeline")):
        base = got[group[0]]["cpu_ms"]
        for name in group:
            print(f"{name:<14}{got[name]['cpu_ms']:>14.3f}{got[name]['cpu_ms'] / base:>8.2f}x{got[name]['rate']:>10.0f}")
    if per_sample:
        print_sample_steps(per_sample)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"images": n, "rounds": rounds, "steps": got, "per_sample": per_sample}, f, indent=2)
    return got


if __name__ == "__main__":
    main()
    os._exit(0)  # no TensorFlow teardown
