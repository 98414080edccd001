"""kpipe.data.from_files(crop=..., flip=...): the random-resized crop and center crop fused into the decode."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import kpipe.data
from kpipe.data._jpeg import Decoder


def _gradient(h, w):
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), np.full_like(x, 128)], -1).astype(np.uint8)


def _save(path, pixels, fmt="JPEG"):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, quality=95)
    path.write_bytes(buffer.getvalue())


@pytest.fixture
def folder(tmp_path):
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(3):
            _save(tmp_path / c / f"{i}.jpg", np.roll(_gradient(60 + 10 * i, 80), 7 * i, axis=1))
    _save(tmp_path / "b" / "3.png", _gradient(64, 64), "PNG")
    return tmp_path


def _epochs(ds, n=2):
    return [np.stack([image for image, _ in ds.as_numpy_iterator()]) for _ in range(n)]


def test_random_crops_depend_on_seed_epoch_and_sample_only(folder):
    make = lambda seed, **kw: kpipe.data.from_files(folder, image_size=(16, 16), crop="random", flip=True, seed=seed, **kw)  # noqa: E731
    first, second = _epochs(make(3))
    again = _epochs(make(3))
    assert np.array_equal(first, again[0]) and np.array_equal(second, again[1])  # same seed: same epochs
    assert not np.array_equal(first, second)  # each epoch draws anew
    assert not np.array_equal(first, _epochs(make(4), 1)[0])
    shards = [_epochs(make(3, num_shards=2, index=i), 1)[0] for i in range(2)]
    # a file's crop does not depend on the shard layout: file i is row i // 2 of shard i % 2
    assert np.array_equal(np.stack([shards[i % 2][i // 2] for i in range(len(first))]), first)


def test_random_crop_through_a_shuffling_pipeline_is_reproducible(folder):
    def run():
        ds = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(16, 16), crop="random", seed=0),
                                 batch_size=3, shuffle=8, seed=5)
        return [np.concatenate([x for x, _ in ds.as_numpy_iterator()]) for _ in range(2)]

    a, b = run(), run()
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a[0]) == 7


def test_center_crop_is_the_central_square(folder):
    pixels = _gradient(80, 120)
    data = tf.constant(tf.io.encode_png(pixels).numpy())
    out = Decoder((35, 35), crop="center", center_fraction=0.5)(data).numpy()
    expect = tf.image.resize(pixels[20:60, 40:80], (35, 35)).numpy()  # side 0.5 * 80 = 40
    np.testing.assert_allclose(out, expect, atol=1e-3)


def test_jpeg_and_png_of_one_image_get_the_same_window(folder):
    pixels = _gradient(90, 120)
    jpeg = tf.io.encode_jpeg(pixels, quality=100).numpy()
    png = tf.io.encode_png(pixels).numpy()
    decoder = Decoder((24, 24), crop="random", scale=(0.2, 0.5))
    seed = tf.constant([1, 2], tf.int64)
    np.testing.assert_allclose(decoder(jpeg, seed).numpy(), decoder(png, seed).numpy(), atol=6)


def test_large_window_is_decoded_at_reduced_scale_and_matches_full_decode():
    pixels = _gradient(512, 640)
    jpeg = tf.io.encode_jpeg(pixels, quality=100).numpy()
    decoder = Decoder((32, 32), crop="center", center_fraction=1.0)  # window 512 >= 8 x 32: 1/8 scale
    full = tf.image.resize(pixels[:, 64:576], (32, 32)).numpy()
    np.testing.assert_allclose(decoder(jpeg).numpy(), full, atol=8)


def test_flip_only_and_bad_arguments(folder):
    plain = kpipe.data.from_files(folder, image_size=(8, 8))
    flipped, pairs = [], []
    for seed in range(4):  # (a few seeds: which images flip depends on TensorFlow's stateless ops)
        ds = kpipe.data.from_files(folder, image_size=(8, 8), flip=True, seed=seed)
        pairs += [(a, b) for (a, _), (b, _) in zip(ds.as_numpy_iterator(), plain.as_numpy_iterator())]
    flipped = [np.array_equal(a, b[:, ::-1]) and not np.array_equal(a, b) for a, b in pairs]
    assert all(f or np.array_equal(a, b) for f, (a, b) in zip(flipped, pairs)) and 0 < sum(flipped) < len(pairs)
    with pytest.raises(ValueError, match="`crop` must be one of"):
        kpipe.data.from_files(folder, crop="inception")
    with pytest.raises(ValueError, match="needs an `image_size`"):
        kpipe.data.from_files(folder, image_size=None, crop="random")
    with pytest.raises(ValueError, match="`scale` must be"):
        kpipe.data.from_files(folder, crop="random", scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="`center_fraction` must be"):
        kpipe.data.from_files(folder, crop="center", center_fraction=0)
