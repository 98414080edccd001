"""kpipe.data.FolderImages: an image folder decoded per sample (PIL / OpenCV / simplejpeg) in
ProcessLoader's workers -- the same samples as PackedImages over the folder's pack, files
that fail named, no TensorFlow in the workers."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import kpipe
import kpipe.data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODERS = ["pil", "cv2"] + (["simplejpeg"] if __import__("importlib").util.find_spec("simplejpeg") else [])


def _photo(value, size, fmt="JPEG", mode="RGB"):
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), value)], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder_images") / "photos"
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(5):  # one large image per class: the window is >= 2x the output (DCT scaling)
            (root / name / f"{i}.jpg").write_bytes(_photo(40 * c + 10 * i, (300, 400) if i == 0 else (60, 80)))
    (root / "cat" / "notes.txt").write_text("not an image: left out by its extension")
    return root


@pytest.mark.parametrize("decoder", DECODERS)
def test_samples_equal_packed_images_over_the_folder_s_pack(folder, tmp_path, decoder):
    # The pack keeps a JPEG's bytes: the same draws from (seed, epoch, j) give the same arrays.
    shards = kpipe.data.pack(folder, tmp_path / "p", verbose=False)["shards"]
    kw = dict(image_size=(24, 32), crop="random", flip=True, seed=5, decoder=decoder)
    files, packed = kpipe.data.FolderImages(folder, **kw), kpipe.data.PackedImages(shards, **kw)
    assert files.class_names == packed.class_names == ["cat", "dog"] and len(files) == len(packed) == 10
    assert files.labels.tolist() == packed.labels.tolist() == [0] * 5 + [1] * 5
    assert [os.path.basename(p) for p in files.paths] == [f"{i}.jpg" for i in range(5)] * 2
    for epoch in range(2):
        for j in range(10):
            a, b = files[j], packed[j]
            np.testing.assert_array_equal(a[0], b[0])
            assert a[1] == b[1]
        files.on_epoch_end(), packed.on_epoch_end()


@pytest.mark.multiprocess
@pytest.mark.parametrize("decoder", DECODERS)
def test_from_samples_batches_equal_the_dataset_called_serially_and_workers_import_no_tensorflow(folder, decoder):
    class Probe:  # the samples, and whether the worker's process has imported TensorFlow
        def __init__(self, images):
            self.images = images

        def __len__(self):
            return len(self.images)

        def __getitem__(self, j):
            image, label = self.images[j]
            return image, label, np.int8("tensorflow" in sys.modules)

    images = kpipe.data.FolderImages(folder, image_size=(16, 16), crop="random", flip=True, seed=1, decoder=decoder)
    with kpipe.ProcessLoader.from_samples(images, 4, workers=2) as loader:  # rows through kpipe_sample_into
        got = [loader[i] for i in range(len(loader))]
    want = [images[j] for j in range(10)]
    assert np.array_equal(np.concatenate([x for x, _ in got]), np.stack([x for x, _ in want]))
    assert np.concatenate([y for _, y in got]).tolist() == [int(y) for _, y in want]
    probe = Probe(kpipe.data.FolderImages(folder, image_size=(16, 16), seed=1, decoder=decoder))
    with kpipe.ProcessLoader.from_samples(probe, 5, workers=1) as loader:
        assert not any(loader[i][2].any() for i in range(len(loader)))


@pytest.mark.parametrize("decoder", DECODERS)
def test_png_grayscale_and_cmyk_files_decode_to_rgb(tmp_path, decoder):
    root = tmp_path / "mixed"
    (root / "a").mkdir(parents=True)
    (root / "a" / "0.png").write_bytes(_photo(90, (40, 50), "PNG"))
    (root / "a" / "1.jpg").write_bytes(_photo(90, (40, 50), mode="L"))
    (root / "a" / "2.jpg").write_bytes(_photo(90, (40, 50), mode="CMYK"))
    (root / "a" / "3.jpeg").write_bytes(_photo(90, (40, 50), "PNG"))  # a PNG named .jpeg: decoded by its bytes
    images = kpipe.data.FolderImages(root, image_size=(20, 25), crop=None, decoder=decoder)
    for j in range(4):
        image, label = images[j]
        assert image.shape == (20, 25, 3) and image.dtype == np.uint8 and label == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("decoder", DECODERS)
def test_a_file_that_does_not_decode_is_named_in_the_loader_s_error(tmp_path, decoder):
    root = tmp_path / "bad"
    (root / "a").mkdir(parents=True)
    for i in range(3):
        (root / "a" / f"{i}.jpg").write_bytes(_photo(10 * i, (40, 50)))
    (root / "a" / "1.jpg").write_bytes(_photo(10, (40, 50))[:200])  # truncated
    images = kpipe.data.FolderImages(root, image_size=(16, 16), decoder=decoder)
    np.testing.assert_array_equal(images[0][0].shape, (16, 16, 3))
    with pytest.raises(ValueError, match=r"1\.jpg.*could not be read or decoded"):
        images[1]
    (root / "a" / "2.jpg").unlink()
    with pytest.raises(ValueError, match=r"2\.jpg.*FileNotFoundError"):
        images[2]
    with pytest.raises(IndexError, match="out of range for 3 images"):
        images[3]
    with kpipe.ProcessLoader.from_samples(images, 1, workers=1) as loader:
        loader[0]
        with pytest.raises(Exception, match=r"1\.jpg"):
            loader[1]


def test_bad_arguments_are_named(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="not an existing folder"):
        kpipe.data.FolderImages(tmp_path / "nope")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="No images"):
        kpipe.data.FolderImages(tmp_path / "empty")
    with pytest.raises(ValueError, match="decoder"):
        kpipe.data.FolderImages(folder, decoder="turbo")
    with pytest.raises(ValueError, match="extensions"):
        kpipe.data.FolderImages(folder, extensions=".jpg")
    with pytest.raises(ValueError, match="image_size"):
        kpipe.data.FolderImages(folder, image_size=(0, 3))
    images = kpipe.data.FolderImages(folder, class_names=["dog"], extensions=[".JPG"])
    assert images.class_names == ["dog"] and len(images) == 5 and set(images.labels.tolist()) == {0}
