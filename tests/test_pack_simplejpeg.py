"""kpipe.data.PackedImages(decoder="simplejpeg"): libjpeg-turbo through simplejpeg, OpenCV's resize.

Skipped where simplejpeg is not installed (`pip install kpipe[jpeg]`), but for the error that
names the extra.
"""

import importlib.util
import io
import pickle
import sys

import numpy as np
import pytest
from PIL import Image

import kpipe
import kpipe.data


def _photo(value, size, mode="RGB"):
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), value)], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed_simplejpeg")
    root = tmp / "photos"
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(6):  # one large image per class: the window is >= 2x the output (DCT scaling)
            (root / name / f"{i}.jpg").write_bytes(_photo(40 * c + 10 * i, (300, 400) if i == 0 else (60, 80)))
    (root / "dog" / "6-gray.jpg").write_bytes(_photo(90, (60, 80), "L"))  # 1 channel
    (root / "dog" / "7-cmyk.jpg").write_bytes(_photo(90, (60, 80), "CMYK"))
    kpipe.data.pack(root, tmp / "p" / "train", shard_size=5, verbose=False)
    return str(tmp / "p" / "train-*.h5")


def test_a_missing_package_names_the_extra(shards, monkeypatch):
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import simplejpeg raises ImportError
    with pytest.raises(ImportError, match=r"`decoder='simplejpeg'` needs the package 'simplejpeg'.*pip install kpipe\[jpeg\]"):
        kpipe.data.PackedImages(shards, decoder="simplejpeg")


needs_simplejpeg = pytest.mark.skipif(importlib.util.find_spec("simplejpeg") is None,
                                      reason="simplejpeg is not installed (pip install kpipe[jpeg])")


@needs_simplejpeg
def test_whole_image_matches_a_plain_resize(shards):
    images = kpipe.data.PackedImages(shards, image_size=(30, 40), crop=None, decoder="simplejpeg")
    assert len(images) == 14 and images.labels.tolist() == [0] * 6 + [1] * 8
    for j in range(14):  # large images (reduced decoding), small ones, grayscale and CMYK
        image, label = images[j]
        assert image.shape == (30, 40, 3) and image.dtype == np.uint8 and label == images.labels[j]
        full = np.asarray(Image.open(io.BytesIO(images.read(j))).convert("RGB").resize((40, 30), Image.BILINEAR), np.float32)
        assert np.abs(image.astype(np.float32) - full).mean() < 6, j  # same picture, RGB order (not BGR)
    import simplejpeg

    assert [simplejpeg.decode_jpeg_header(images.read(j))[2] for j in (12, 13)] == ["Gray", "CMYK"]  # (kept as is)


@needs_simplejpeg
def test_reduced_decoding_is_the_dct_scale_opencv_uses(shards):
    """The large images' windows are >= 2x the output: decoded at 1/2..1/8, the same scale and
    crop as OpenCV's IMREAD_REDUCED_COLOR_*, so the two decoders agree but for rounding."""
    import simplejpeg

    data = kpipe.data.PackedImages(shards, decoder="simplejpeg").read(0)
    assert simplejpeg.decode_jpeg(data, min_height=75, min_width=100).shape == (75, 100, 3)  # the 1/4 scale, no other
    for crop in ("random", "center", None):
        a = kpipe.data.PackedImages(shards, image_size=(32, 32), crop=crop, flip=True, seed=2, decoder="simplejpeg")
        b = kpipe.data.PackedImages(shards, image_size=(32, 32), crop=crop, flip=True, seed=2, decoder="cv2")
        for j in range(14):
            diff = np.abs(a[j][0].astype(np.int16) - b[j][0].astype(np.int16))
            assert diff.mean() < 2 and diff.max() <= 32, (crop, j, diff.mean(), diff.max())


@needs_simplejpeg
def test_draws_depend_on_seed_epoch_and_sample_only(shards):
    def make(seed):
        return kpipe.data.PackedImages(shards, image_size=(16, 16), crop="random", flip=True, seed=seed, decoder="simplejpeg")

    a, b = make(3), pickle.loads(pickle.dumps(make(3)))
    first = [a[j][0] for j in range(14)]
    for j in reversed(range(14)):
        np.testing.assert_array_equal(b[j][0], first[j])
    a.on_epoch_end()
    assert any(not np.array_equal(a[j][0], first[j]) for j in range(14))


@needs_simplejpeg
def test_sample_into_writes_what_getitem_returns(shards):
    for crop in ("random", "center", None):
        images = kpipe.data.PackedImages(shards, image_size=(20, 24), crop=crop, flip=True, seed=5, decoder="simplejpeg")
        out = (np.full((20, 24, 3), 7, np.uint8), np.full((), -1, np.int32))
        for j in range(14):
            images.kpipe_sample_into(j, out)
            image, label = images[j]
            np.testing.assert_array_equal(out[0], image)
            assert out[1] == label == images.labels[j]


@needs_simplejpeg
def test_names_an_image_neither_decoder_can_read(shards):
    images = kpipe.data.PackedImages(shards, image_size=(8, 8), decoder="simplejpeg", seed=0)
    images.read = lambda j: b"\xff\xd8 not a JPEG"
    with pytest.raises(ValueError, match="OpenCV cannot decode a packed image of 13 bytes"):
        images[0]


@pytest.mark.multiprocess
@needs_simplejpeg
def test_process_loader_reads_the_shards_in_workers(shards):
    images = kpipe.data.PackedImages(shards, image_size=(16, 16), crop="random", flip=True, seed=1, decoder="simplejpeg")
    expected = pickle.loads(pickle.dumps(images))
    with kpipe.ProcessLoader.from_samples(images, 7, shuffle=False, workers=2) as loader:
        x = np.concatenate([loader[i][0] for i in range(len(loader))])
    np.testing.assert_array_equal(x, np.stack([expected[j][0] for j in range(14)]))
