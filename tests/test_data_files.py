"""kpipe.data.from_files: image folders, labels, shards, undecodable files."""

import numpy as np
import pytest
import tensorflow as tf

import kpipe.data

PER_CLASS = {"cat": 5, "dog": 3, "eel": 4}


def _png(value, size=(10, 12)):
    return tf.io.encode_png(np.full(size + (3,), value, np.uint8)).numpy()


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    for c, (name, count) in enumerate(PER_CLASS.items()):
        (root / name / "sub").mkdir(parents=True)
        for i in range(count):
            # pixel value encodes (class, index) so every sample can be identified
            where = root / name / ("sub" if i == 0 else "") / f"{i}.png"
            where.write_bytes(_png(c * 50 + i, size=(10 + i, 12)))
    (root / "cat" / "notes.txt").write_text("not an image, ignored by extension")
    return root


def _keys(ds):
    return [(int(label), int(round(float(image[0, 0, 0])))) for image, label in ds.as_numpy_iterator()]


def _all_keys():
    return sorted((c, c * 50 + i) for c, n in enumerate(PER_CLASS.values()) for i in range(n))


def test_labels_sizes_and_exactly_once(folder):
    ds = kpipe.data.from_files(folder, image_size=(8, 8))
    assert ds.class_names == ["cat", "dog", "eel"]
    assert ds.element_spec[0].shape == (8, 8, 3) and ds.element_spec[0].dtype == tf.float32
    assert sorted(_keys(ds)) == _all_keys()


def test_class_names_choose_and_order_classes(folder):
    ds = kpipe.data.from_files(folder, image_size=(4, 4), class_names=["eel", "cat"], channels=1)
    keys = _keys(ds)
    assert sorted({label for label, _ in keys}) == [0, 1]
    assert sum(1 for label, _ in keys if label == 0) == PER_CLASS["eel"]
    assert ds.element_spec[0].shape == (4, 4, 1)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shards_are_disjoint_and_complete(folder, num_shards):
    seen = []
    for index in range(num_shards):
        seen.extend(_keys(kpipe.data.from_files(folder, image_size=(4, 4), num_shards=num_shards, index=index)))
    assert sorted(seen) == _all_keys()


def test_undecodable_file_fails_naming_it(folder):
    (folder / "dog" / "broken.png").write_bytes(b"this is not a png")
    ds = kpipe.data.from_files(folder, image_size=(4, 4))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cannot decode image file.*dog/broken\.png"):
        list(ds.as_numpy_iterator())


def test_truncated_file_fails_naming_it(folder):
    (folder / "eel" / "cut.png").write_bytes(_png(1)[:40])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"eel/cut\.png"):
        list(kpipe.data.from_files(folder, image_size=(4, 4)).as_numpy_iterator())


def test_skip_mode_drops_and_counts_bad_files(folder, capfd):
    (folder / "dog" / "broken.png").write_bytes(b"nope")
    (folder / "eel" / "cut.png").write_bytes(_png(1)[:40])
    ds = kpipe.data.from_files(folder, image_size=(4, 4), on_error="skip")
    assert sorted(_keys(ds)) == _all_keys()
    err = capfd.readouterr().err
    assert "broken.png" in err and "cut.png" in err and "2 skipped so far" in err


def test_keep_size_without_resize(folder):
    ds = kpipe.data.from_files(folder, image_size=None, class_names=["dog"])
    shapes = sorted(image.shape for image, _ in ds.as_numpy_iterator())
    assert shapes == [(10, 12, 3), (11, 12, 3), (12, 12, 3)]
    assert ds.element_spec[0].dtype == tf.uint8


def test_bad_folders_and_arguments(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="is not an existing folder"):
        kpipe.data.from_files(tmp_path / "nowhere")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(_png(0))
    with pytest.raises(ValueError, match="has no sub-folders"):
        kpipe.data.from_files(tmp_path / "flat")
    (tmp_path / "flat" / "empty_class").mkdir()
    with pytest.raises(ValueError, match="No images in the class folders"):
        kpipe.data.from_files(tmp_path / "flat")
    with pytest.raises(FileNotFoundError, match="Class folder 'cow'"):
        kpipe.data.from_files(folder, class_names=["cat", "cow"])
    with pytest.raises(ValueError, match="`on_error` must be one of"):
        kpipe.data.from_files(folder, on_error="ignore")
    with pytest.raises(ValueError, match="`channels` must be 1, 3 or 4"):
        kpipe.data.from_files(folder, channels=2)
