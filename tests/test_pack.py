"""kpipe.data.pack / `kpipe pack` and kpipe.data.from_packed: same samples as the folder, resume, bad files."""

import io
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

import kpipe.data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jpeg(value, size=(48, 64), fmt="JPEG", mode="RGB"):
    buffer = io.BytesIO()
    pixels = np.full(size + (3,), value, np.uint8)
    pixels[: size[0] // 2] //= 2
    Image.fromarray(pixels).convert(mode).save(buffer, fmt, quality=95)
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "photos"
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(5):
            (root / name / f"{i}.jpg").write_bytes(_jpeg(40 * c + 10 * i))
    (root / "dog" / "9.png").write_bytes(_jpeg(200, fmt="PNG"))  # not a JPEG: stored re-encoded
    return root


def _samples(ds):
    return [(int(y), x) for x, y in ds.as_numpy_iterator()]


def test_packed_reads_what_the_folder_reads(folder, tmp_path):
    out = kpipe.data.pack(folder, tmp_path / "p" / "train", shard_size=4, verbose=False)
    assert out["images"] == 11 and len(out["shards"]) == 3 and out["class_names"] == ["cat", "dog"]
    packed = kpipe.data.from_packed(str(tmp_path / "p" / "train-*.h5"), image_size=(16, 16), block_size=3)
    files = kpipe.data.from_files(folder, image_size=(16, 16))
    a, b = _samples(packed), _samples(files)
    assert [y for y, _ in a] == [y for y, _ in b] and packed.class_names == files.class_names
    for (_, x), (_, z) in zip(a[:10], b[:10]):  # the JPEGs keep their bytes: identical pixels
        np.testing.assert_array_equal(x, z)
    np.testing.assert_allclose(a[10][1], b[10][1], atol=8)  # the PNG, re-encoded as JPEG
    assert kpipe.data.class_weights(packed) == kpipe.data.class_weights(files)


def test_max_side_and_augmented_shards(folder, tmp_path):
    (folder / "cat" / "big.jpg").write_bytes(_jpeg(90, size=(600, 800)))
    out = kpipe.data.pack(folder, tmp_path / "small", max_side=100, verbose=False)
    with h5py.File(out["shards"][0], "r") as f:
        blob, off = f["bytes"][:].tobytes(), f["offsets"][:]
        sizes = [Image.open(io.BytesIO(blob[a:b])).size for a, b in zip(off[:-1], off[1:])]
    assert max(max(s) for s in sizes) == 100 and (100, 75) in sizes
    seen = []
    for index in range(2):
        ds = kpipe.data.from_packed(out["shards"], image_size=(8, 8), crop="random", flip=True, seed=1, num_shards=2,
                                    index=index, block_size=2)
        seen += [y for _, y in ds.as_numpy_iterator()]
    assert sorted(seen) == sorted([0] * 6 + [1] * 6)
    ds = kpipe.data.pipeline(kpipe.data.from_packed(out["shards"], image_size=(8, 8), crop="random", seed=1),
                             batch_size=5, shuffle=8, seed=3)
    epochs = [np.concatenate([x for x, _ in ds.as_numpy_iterator()]) for _ in range(2)]
    assert len(epochs[0]) == 12 and not np.array_equal(epochs[0], epochs[1])


def test_resume_keeps_complete_shards_and_redoes_a_partial_one(folder, tmp_path):
    prefix = tmp_path / "train"
    first = kpipe.data.pack(folder, prefix, shard_size=4, verbose=False)
    os.replace(first["shards"][2], first["shards"][2] + ".partial")  # as if killed while writing it
    again = kpipe.data.pack(folder, prefix, shard_size=4, verbose=False)
    assert again["reused"] == 2 and again["images"] == 11 and os.path.exists(first["shards"][2])
    other = kpipe.data.pack(folder, prefix, shard_size=4, max_side=32, verbose=False)  # new settings: rewritten
    assert other["reused"] == 0


def test_bad_files_are_named_or_skipped(folder, tmp_path):
    (folder / "dog" / "cut.jpg").write_bytes(_jpeg(5)[:200])
    with pytest.raises(ValueError, match=r"cannot read or decode image file .*dog/cut\.jpg"):
        kpipe.data.pack(folder, tmp_path / "a", verbose=False)
    out = kpipe.data.pack(folder, tmp_path / "b", on_error="skip", verbose=False)
    assert out["images"] == 11 and [os.path.basename(p) for p in out["skipped"]] == ["cut.jpg"]
    with pytest.raises(ValueError, match="not a complete kpipe pack"):
        bad = tmp_path / "x.h5"
        h5py.File(bad, "w").close()
        kpipe.data.from_packed(str(bad))


def test_cli(folder, tmp_path):
    (folder / "dog" / "cut.jpg").write_bytes(b"nope")
    cmd = [sys.executable, "-m", "kpipe.cli", "pack", str(folder), str(tmp_path / "c"), "--max-side", "32", "--shard-size", "6"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode == 1 and "cut.jpg" in failed.stderr
    done = subprocess.run(cmd + ["--on-error", "skip"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "11 images in 2 shards" in done.stdout and "1 skipped" in done.stdout and "cut.jpg" in done.stderr
