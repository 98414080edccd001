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


def steps(folder):
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1280, help="JPEGs in the folder. Default: 1280")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds over all steps. Default: 3")
    parser.add_argument("--quick", action="store_true", help="64 images, 1 round (a smoke run)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from _workloads.jpeg_folder import make_folder

    n, rounds = (64, 1) if args.quick else (args.images, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kpipe-jpeg-steps-") as tmp:
        photo = make_folder(os.path.join(tmp, "photos"), n)
        got = measure(steps(os.path.join(tmp, "photos")), rounds)
    print(f"{n} JPEGs (~500x375, from {photo}) to 224x224, batch {BATCH}, one process, {rounds} interleaved rounds "
          f"after 1 untimed; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'step':<14}{'CPU ms/image':>14}{'x first':>9}{'images/s':>10}")
    for group in (("keras", "map", "map+ignore", "source", "source-skip", "pipeline"), ("ref-rrc", "decoder-rrc", "source-rrc", "pipeline-rrc")):
        base = got[group[0]]["cpu_ms"]
        for name in group:
            print(f"{name:<14}{got[name]['cpu_ms']:>14.3f}{got[name]['cpu_ms'] / base:>8.2f}x{got[name]['rate']:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"images": n, "rounds": rounds, "steps": got}, f, indent=2)
    return got


if __name__ == "__main__":
    main()
    os._exit(0)  # no TensorFlow teardown
