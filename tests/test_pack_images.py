"""kpipe.data.PackedImages: packed shards decoded per sample (PIL / OpenCV) in ProcessLoader's workers."""

import io
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import kpipe
import kpipe.data
from kpipe.data._packed_images import jpeg_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _photo(value, size):
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), value)], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed_images")
    root = tmp / "photos"
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(6):  # one large image per class: the window is >= 2x the output (DCT scaling)
            (root / name / f"{i}.jpg").write_bytes(_photo(40 * c + 10 * i, (300, 400) if i == 0 else (60, 80)))
    kpipe.data.pack(root, tmp / "p" / "train", shard_size=5, verbose=False)
    return str(tmp / "p" / "train-*.h5")


@pytest.mark.parametrize("decoder", ["pil", "cv2"])
def test_whole_image_matches_a_plain_resize(shards, decoder):
    images = kpipe.data.PackedImages(shards, image_size=(30, 40), crop=None, decoder=decoder)
    assert len(images) == 12 and images.class_names == ["cat", "dog"] and images.labels.tolist() == [0] * 6 + [1] * 6
    for j in (0, 7):  # a large image (reduced decoding) and a small one
        image, label = images[j]
        assert image.shape == (30, 40, 3) and image.dtype == np.uint8 and label == images.labels[j]
        full = np.asarray(Image.open(io.BytesIO(images.read(j))).convert("RGB").resize((40, 30), Image.BILINEAR), np.float32)
        assert np.abs(image.astype(np.float32) - full).mean() < 6  # same picture, RGB order (not BGR)


@pytest.mark.parametrize("decoder", ["pil", "cv2"])
def test_draws_depend_on_seed_epoch_and_sample_only(shards, decoder):
    def make(seed):
        return kpipe.data.PackedImages(shards, image_size=(16, 16), crop="random", flip=True, seed=seed, decoder=decoder)

    a, b = make(3), pickle.loads(pickle.dumps(make(3)))
    first = [a[j][0] for j in range(12)]
    for j in reversed(range(12)):  # another order, another object: the same crops
        np.testing.assert_array_equal(b[j][0], first[j])
    a.on_epoch_end()
    assert a.epoch == 1 and any(not np.array_equal(a[j][0], first[j]) for j in range(12))
    assert any(not np.array_equal(make(4)[j][0], first[j]) for j in range(12))


def test_window_parameters_are_from_packed_s():
    images = object.__new__(kpipe.data.PackedImages)
    images.crop, images.scale, images.center_fraction = "random", (0.25, 0.5), 0.875
    images.log_ratio = (np.log(3 / 4), np.log(4 / 3))
    rng = np.random.default_rng(0)
    for _ in range(200):
        x, y, w, h = images.window(400, 300, rng)
        assert 0 <= x and x + w <= 400 and 0 <= y and y + h <= 300
        assert 0.2 <= w * h / 120000 <= 0.55 and 0.7 <= w / h <= 1.4
    images.crop = "center"
    assert images.window(400, 300, rng) == (69, 19, 262, 262)
    images.crop, images.scale = "random", (0.99, 1.0)
    images.log_ratio = (np.log(3.0), np.log(4.0))  # cannot fit: the whole image, as tf.image's
    assert images.window(400, 300, rng) == (0, 0, 400, 300)


def test_jpeg_size_reads_the_header():
    assert jpeg_size(_photo(0, (30, 50))) == (50, 30)
    assert jpeg_size(b"\x89PNG\r\n\x1a\n....") is None


def test_bad_arguments_name_themselves(shards, tmp_path):
    with pytest.raises(ValueError, match="`decoder` must be one of"):
        kpipe.data.PackedImages(shards, decoder="turbo")
    with pytest.raises(ValueError, match="`image_size`"):
        kpipe.data.PackedImages(shards, image_size=None)
    with pytest.raises(ValueError, match="`scale`"):
        kpipe.data.PackedImages(shards, scale=(0.5, 2.0))
    with pytest.raises(FileNotFoundError):
        kpipe.data.PackedImages(str(tmp_path / "none-*.h5"))
    with pytest.raises(IndexError, match="out of range"):
        kpipe.data.PackedImages(shards)[12]


@pytest.mark.parametrize("decoder", ["pil", "cv2"])
def test_sample_into_writes_what_getitem_returns(shards, decoder):
    for crop in ("random", "center", None):
        images = kpipe.data.PackedImages(shards, image_size=(20, 24), crop=crop, flip=True, seed=5, decoder=decoder)
        out = (np.full((20, 24, 3), 7, np.uint8), np.full((), -1, np.int32))
        for j in range(12):  # (image 0 and 6 are large: reduced decoding; about half are flipped)
            images.kpipe_sample_into(j, out)
            image, label = images[j]
            np.testing.assert_array_equal(out[0], image)
            assert out[1] == label == images.labels[j]
    with pytest.raises(ValueError, match=r"`out` must be \(image, label\) arrays, the image of shape \(20, 24, 3\)"):
        images.kpipe_sample_into(0, (np.zeros((24, 20, 3), np.uint8), np.zeros((), np.int32)))


def test_cv2_names_an_image_it_cannot_decode(shards):
    images = kpipe.data.PackedImages(shards, image_size=(8, 8), decoder="cv2", seed=0)
    images.read = lambda j: b"\xff\xd8 not a JPEG"
    with pytest.raises(ValueError, match="OpenCV cannot decode a packed image of 13 bytes"):
        images[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("decoder", ["pil", "cv2"])
def test_process_loader_reads_the_shards_in_workers(shards, decoder):
    images = kpipe.data.PackedImages(shards, image_size=(16, 16), crop="random", flip=True, seed=1, decoder=decoder)
    expected = pickle.loads(pickle.dumps(images))
    images[0]  # opens a shard here: the workers must open their own
    with kpipe.ProcessLoader.from_samples(images, 5, shuffle=False, workers=2) as loader:
        epochs = []
        for _ in range(2):
            epochs.append([loader[i] for i in range(len(loader))])
            loader.on_epoch_end()
    x0 = np.concatenate([x for x, _ in epochs[0]])
    assert x0.shape == (12, 16, 16, 3) and np.concatenate([y for _, y in epochs[0]]).tolist() == images.labels.tolist()
    assert images.epoch == 2  # the loader runs the dataset's hook (here and in its workers)
    np.testing.assert_array_equal(x0, np.stack([expected[j][0] for j in range(12)]))  # the workers drew epoch 0's crops
    expected.on_epoch_end()
    np.testing.assert_array_equal(np.concatenate([x for x, _ in epochs[1]]), np.stack([expected[j][0] for j in range(12)]))


@pytest.mark.multiprocess
def test_workers_do_not_import_tensorflow(shards):
    code = (
        "import sys, numpy as np, kpipe, kpipe.data\n"
        "class Seen(kpipe.data.PackedImages):\n"
        "    def __getitem__(self, j):\n"
        "        return super().__getitem__(j)[0], np.int32('tensorflow' in sys.modules)\n"
        "    def kpipe_sample_into(self, j, out):\n"
        "        super().kpipe_sample_into(j, out)\n"
        "        out[1][...] = 'tensorflow' in sys.modules\n"
        f"images = Seen({shards!r}, image_size=(8, 8), decoder='cv2', seed=0)\n"
        "with kpipe.ProcessLoader.from_samples(images, 4, workers=1) as loader:\n"
        "    x, y = loader[0]\n"
        "print(x.shape, y.tolist())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["(4,", "8,", "8,", "3)", "[0,", "0,", "0,", "0]"]  # no worker imported TensorFlow
