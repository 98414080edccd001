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
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cannot read or decode image file.*dog/broken\.png"):
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


def _encoded(fmt, mode="RGB", size=(40, 50), **kw):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full(size + (3,), 120, np.uint8)).convert(mode).save(buffer, fmt, **kw)
    return buffer.getvalue()


def test_images_named_jpg_are_decoded_by_their_bytes(tmp_path):
    # PNG, grayscale and CMYK JPEGs, RGBA PNG, GIF and BMP, all named .jpg: decoded as Keras does.
    kinds = {"png": ("PNG", "RGB"), "gray": ("JPEG", "L"), "cmyk": ("JPEG", "CMYK"), "rgba": ("PNG", "RGBA"),
             "gif": ("GIF", "RGB"), "bmp": ("BMP", "RGB")}
    (tmp_path / "a").mkdir()
    for name, (fmt, mode) in kinds.items():
        (tmp_path / "a" / f"{name}.jpg").write_bytes(_encoded(fmt, mode))
    for crop in (None, "random", "center"):
        images = [image for image, _ in kpipe.data.from_files(tmp_path, image_size=(8, 8), crop=crop, seed=0).as_numpy_iterator()]
        assert len(images) == len(kinds) and all(image.shape == (8, 8, 3) for image in images)


def test_exif_orientation_is_not_applied_as_in_keras(tmp_path):
    from PIL import Image

    (tmp_path / "a").mkdir()
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = 255  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    Image.fromarray(pixels).save(tmp_path / "a" / "rotated.jpg", exif=exif, quality=95)
    (image, _), = kpipe.data.from_files(tmp_path, image_size=None).as_numpy_iterator()
    assert image.shape == (20, 40, 3) and image[:, :10].mean() > 200 and image[:, -10:].mean() < 50


def test_empty_class_folder_keeps_its_label(folder):
    (folder / "aardvark").mkdir()
    ds = kpipe.data.from_files(folder, image_size=(4, 4))
    assert ds.class_names == ["aardvark", "cat", "dog", "eel"]
    assert sorted({label for label, _ in _keys(ds)}) == [1, 2, 3]


_BAD = {"cat/0000-first.png": b"", "dog/text.jpg": b"not an image at all", "eel/zz-truncated.jpg": None}


def _write_bad(folder, names):
    for name in names:
        (folder / name).write_bytes(_encoded("JPEG")[:300] if _BAD[name] is None else _BAD[name])


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_names_and_counts_bad_files_first_middle_and_last(folder, capfd, shuffle):
    _write_bad(folder, _BAD)
    source = kpipe.data.from_files(folder, image_size=(4, 4), on_error="skip")
    ds = kpipe.data.pipeline(source, batch_size=4, shuffle=16 if shuffle else None, seed=1)
    labels = np.concatenate([y for _, y in ds.as_numpy_iterator()])
    assert len(labels) == sum(PER_CLASS.values())
    err = capfd.readouterr().err
    assert all(name.split("/")[1] in err for name in _BAD) and "3 skipped so far" in err


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("bad", sorted(_BAD))
def test_raise_names_the_bad_file_first_middle_or_last(folder, bad, shuffle):
    _write_bad(folder, [bad])
    ds = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(4, 4)), batch_size=4,
                             shuffle=16 if shuffle else None, seed=1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=bad.replace(".", r"\.")):
        list(ds.as_numpy_iterator())


def test_unreadable_file_is_named(folder):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their permissions")
    bad = folder / "dog" / "locked.png"
    bad.write_bytes(_png(3))
    bad.chmod(0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dog/locked\.png"):
        list(kpipe.data.from_files(folder, image_size=(4, 4)).as_numpy_iterator())


def test_raise_names_the_file_after_the_pass_s_good_samples(folder):
    (folder / "cat" / "0-first.png").write_bytes(b"not a png")  # storage order: the first file
    got = []
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cannot read or decode image file.*cat/0-first\.png"):
        for sample in kpipe.data.from_files(folder, image_size=(4, 4)).as_numpy_iterator():
            got.append(sample)
    assert len(got) == sum(PER_CLASS.values())  # every good sample came first (see _decoded.py's NOTE)


def test_a_pass_without_failures_never_reads_the_naming_pass(folder, monkeypatch):
    import kpipe.data._files as files

    def tripwire(n, read, name_of, channels, blank, what):
        def fail(_):
            check = tf.debugging.Assert(False, ["tripwire: the naming pass was read"])
            with tf.control_dependencies([check]):
                return tuple(tf.identity(t) for t in blank)
        return tf.data.Dataset.from_tensors(tf.constant(0)).map(fail)

    monkeypatch.setattr(files, "named", tripwire)
    for crop, shuffle in ((None, None), ("random", 8)):
        ds = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(4, 4), crop=crop, seed=0), batch_size=5,
                                 shuffle=shuffle, seed=1)
        for _ in range(2):
            assert sum(len(y) for _, y in ds.as_numpy_iterator()) == sum(PER_CLASS.values())
    (folder / "dog" / "broken.png").write_bytes(b"nope")
    with pytest.raises(tf.errors.InvalidArgumentError, match="tripwire: the naming pass was read"):
        list(kpipe.data.from_files(folder, image_size=(4, 4)).as_numpy_iterator())


def test_naming_pass_names_the_first_bad_file_or_says_the_failure_did_not_repeat(folder):
    from kpipe.data._decoded import named

    names = tf.constant(["a.png", "b.png", "c.png"])
    good, bad = _png(1), b"not an image"
    blank = (tf.zeros([4, 4, 3]), tf.constant(0, tf.int32))
    for files, message in (((good, bad, bad), r"cannot read or decode image file.*b\.png"),
                           ((good, good, good), "every file reads and decodes now")):
        data = tf.constant(list(files))
        ds = named(3, lambda j: data[j], lambda j: names[j], 3, blank, "kpipe.data.from_files")
        assert ds.element_spec == tuple(tf.TensorSpec.from_tensor(t) for t in blank)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            list(ds.as_numpy_iterator())


def _graph_ops(ds):
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return {node.op for node in graph.node} | {n.op for f in graph.library.function for n in f.node_def}


def test_pipeline_shuffle_true_adds_no_buffer_to_files_already_permuted_each_epoch(folder):
    # from_files reads every file in a new uniformly random order each epoch: a shuffle buffer
    # of decoded images after it only made each epoch wait for it to fill (0.6-0.9 s for 851
    # images of 224x224), and held up to 512 MB. A number still asks for a buffer.
    ds = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(8, 8)), batch_size=4, shuffle=True, seed=3)
    assert not any(op.startswith("ShuffleDataset") for op in _graph_ops(ds))
    epochs = [[(int(y), int(round(float(x[0, 0, 0])))) for xb, yb in ds.as_numpy_iterator() for x, y in zip(xb, yb)]
              for _ in range(3)]
    assert all(sorted(e) == _all_keys() for e in epochs)  # every sample once per epoch ...
    assert len({tuple(e) for e in epochs}) == 3 and tuple(epochs[0]) != tuple(_all_keys())  # ... in a new order
    again = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(8, 8)), batch_size=4, shuffle=True, seed=3)
    assert [(int(y), int(round(float(x[0, 0, 0])))) for xb, yb in again.as_numpy_iterator() for x, y in zip(xb, yb)] == epochs[0]
    buffered = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(8, 8)), batch_size=4, shuffle=5, seed=3)
    assert any(op.startswith("ShuffleDataset") for op in _graph_ops(buffered))
    cached = kpipe.data.pipeline(kpipe.data.from_files(folder, image_size=(8, 8)), batch_size=4, shuffle=True, seed=3, cache=True)
    assert any(op.startswith("ShuffleDataset") for op in _graph_ops(cached))  # (a cache keeps storage order: the buffer shuffles)
