"""Differential suite for `kpipe.data` (issue 51): generated sources and pipelines, each
compared with NumPy / h5py / plain tf.data doing the same, element by element, by bytes.

Every case is drawn from its own seeded `random.Random(case)`, so a failure names a case
number that reproduces it (`"tests/test_data_differential.py::test_source[numpy-17]"`). The default suite runs a fixed
budget of cases; the `slow` marker runs many more of the same kinds.

What "the same" means for each part:
* sources: `from_numpy` (arrays of many dtypes and shapes, views, Fortran order, `.npy`
  memmaps, dict inputs), `from_hdf5` (files of odd lengths, chunked or not, gzip/lzf,
  globs) and `from_tfrecord` (fixed, sequence, var-len, ragged and bytes features, GZIP)
  against the arrays, h5py's reads, and `TFRecordDataset` + `parse_single_example` with
  the same file interleave -- in order, element specs equal; and sharded 2-7 ways, all
  shard indices together against the whole, each sample exactly once;
* pipelines (batch, drop_remainder, cache, repeat, `map_fn`): against plain tf.data over
  the same arrays, in order; with a seeded shuffle, each epoch against the same multiset
  (every sample once per pass) and a rebuilt pipeline against the first (same bytes);
  shards: all shard indices together against the whole, each sample exactly once;
* `py_map_fn`: against the same pipeline without it, with the function applied serially
  in NumPy -- with randomness, reseeding `random`/`numpy.random` per element by the
  documented rule `(seed, iteration, element index)`; and across two fresh processes
  with 1 and 2 workers.
"""

import functools
import itertools
import os
import random
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import tensorflow as tf

import kpipe.data
from kpipe._engine.worker_info import batch_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CASES = 8  # per kind, in the default suite
SLOW_CASES = 60  # per kind, under the `slow` marker
_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64"]


def _cases(default=DEFAULT_CASES, slow=SLOW_CASES):
    return [pytest.param(c, id=str(c)) for c in range(default)] + [
        pytest.param(c, id=str(c), marks=pytest.mark.slow) for c in range(default, default + slow)
    ]


# -- comparing by bytes ------------------------------------------------------------------------


def _key(value):
    a = np.asarray(value)
    return (a.shape, a.dtype.str, a.tobytes())


def _leaves(value):
    """The arrays of an element in a fixed order: dicts by sorted key, sparse/ragged values
    as their parts."""
    if isinstance(value, dict):
        return [leaf for k in sorted(value) for leaf in _leaves(value[k])]
    if isinstance(value, (tuple, list)) and not hasattr(value, "dense_shape"):
        return [leaf for v in value for leaf in _leaves(v)]
    if hasattr(value, "dense_shape"):  # a sparse tensor value
        return [np.asarray(value.indices), np.asarray(value.values), np.asarray(value.dense_shape)]
    if hasattr(value, "flat_values"):  # a ragged tensor value
        parts = [np.asarray(value.flat_values)]
        parts += [np.asarray(s) for s in value.nested_row_splits]
        return parts
    return [np.asarray(value)]


def _keys(element):
    return tuple(_key(leaf) for leaf in _leaves(element))


def _elements(ds):
    return [_keys(e) for e in ds.as_numpy_iterator()]


def _rows(batches):
    """Splits a list of batches (tuples/dicts of arrays) into per-sample keys."""
    out = []
    for batch in batches:
        leaves = _leaves(batch)
        for i in range(len(leaves[0])):
            out.append(tuple(_key(leaf[i]) for leaf in leaves))
    return out


def _assert_same(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} elements, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{what}: element {i} differs: {str(g)[:300]} != {str(w)[:300]}"


# -- generated arrays --------------------------------------------------------------------------


def _array(rng, n, dtype, shape):
    np_rng = np.random.default_rng(rng.randrange(2**32))
    size = (n,) + shape
    if dtype == "bool":
        return np_rng.integers(0, 2, size).astype(bool)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return np_rng.integers(info.min, info.max, size, endpoint=True, dtype=dtype)
    return (np_rng.standard_normal(size) * 100).astype(dtype)


def _shape(rng):
    return rng.choice([(), (1,), (3,), (2, 3), (4, 1, 2)])


def _labels(rng, n):
    dtype = rng.choice(["int32", "int64", "uint8"])
    return np.random.default_rng(rng.randrange(2**32)).integers(0, 5, n).astype(dtype)


# -- sources -----------------------------------------------------------------------------------


def _numpy_case(rng, tmp_path):
    """Returns `(make, reference arrays in element structure, description)`; `make(**shard)`
    builds the source (with `num_shards`/`index` if given)."""
    n = rng.randint(1, 37)
    x = _array(rng, n, rng.choice(_DTYPES), _shape(rng))
    layout = rng.choice(["plain", "view", "fortran", "npy"])
    if layout == "view" and x.ndim >= 1:
        base = np.stack([x, x], axis=1)  # (n, 2, ...): every other row of a wider array
        x = base[:, 0]
    elif layout == "fortran":
        x = np.asfortranarray(x)
    elif layout == "npy":
        path = str(tmp_path / f"x-{rng.randrange(10**9)}.npy")
        np.save(path, x)
        x = np.load(path, mmap_mode="r")
    y = _labels(rng, n) if rng.random() < 0.7 else None
    block = rng.choice([None, 1, 2, 3, 5, 8])
    if rng.random() < 0.3:
        x2 = _array(rng, n, rng.choice(_DTYPES), _shape(rng))
        inputs = {"a": x, "b": x2}
        make = functools.partial(kpipe.data.from_numpy, inputs, y, block_size=block)
        arrays = ({"a": np.asarray(x), "b": x2}, y) if y is not None else {"a": np.asarray(x), "b": x2}
    else:
        make = functools.partial(kpipe.data.from_numpy, x, y, block_size=block)
        arrays = (np.asarray(x), y) if y is not None else np.asarray(x)
    return make, arrays, f"from_numpy n={n} {layout} dtype={x.dtype} shape={x.shape[1:]} block={block}"


def _hdf5_case(rng, tmp_path):
    folder = tmp_path / f"h5-{rng.randrange(10**9)}"
    folder.mkdir()
    dtype, shape = rng.choice(_DTYPES), _shape(rng)
    label_dtype = rng.choice(["int32", "int64", "uint8"])
    chunked = rng.choice([None, 1, 3, 4, 7])
    compression = rng.choice([None, "gzip", "lzf"]) if chunked else None
    xs, ys, paths = [], [], []
    for f in range(rng.randint(1, 3)):
        n = rng.randint(1, 23)
        x = _array(rng, n, dtype, shape)
        y = _labels(rng, n).astype(label_dtype)
        path = str(folder / f"part-{f}.h5")
        with h5py.File(path, "w") as h5:
            kw = {}
            if chunked:
                kw = {"chunks": (min(chunked, n),) + shape, "compression": compression}
            h5.create_dataset("x", data=x, **kw)
            h5.create_dataset("labels/y", data=y)
        xs.append(x)
        ys.append(y)
        paths.append(path)
    # the reference reads with h5py, file after file
    ref_x, ref_y = [], []
    for path in paths:
        with h5py.File(path, "r") as h5:
            ref_x.append(h5["x"][()])
            ref_y.append(h5["labels/y"][()])
    ref_x, ref_y = np.concatenate(ref_x), np.concatenate(ref_y)
    assert np.array_equal(ref_x, np.concatenate(xs))  # h5py reads back what was written
    block = rng.choice([None, 1, 2, 5, 9])
    where = str(folder / "part-*.h5") if rng.random() < 0.5 else paths
    with_y = rng.random() < 0.8
    make = functools.partial(kpipe.data.from_hdf5, where, x="x", y="labels/y" if with_y else None, block_size=block)
    arrays = (ref_x, ref_y) if with_y else ref_x
    return make, arrays, (
        f"from_hdf5 files={[len(x) for x in xs]} dtype={dtype} shape={shape} chunks={chunked} "
        f"compression={compression} block={block} glob={isinstance(where, str)}"
    )


def _tfrecord_case(rng, tmp_path):
    folder = tmp_path / f"tfr-{rng.randrange(10**9)}"
    folder.mkdir()
    width = rng.randint(1, 3)
    kinds = ["id"] + rng.sample(["fixed", "seq", "varlen", "ragged", "bytes"], rng.randint(1, 4))
    features = {"id": tf.io.FixedLenFeature([], tf.int64)}
    if "fixed" in kinds:
        features["fixed"] = tf.io.FixedLenFeature([width], tf.float32)
    if "seq" in kinds:
        features["seq"] = tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True)
    if "varlen" in kinds:
        features["varlen"] = tf.io.VarLenFeature(tf.float32)
    if "ragged" in kinds:
        features["ragged"] = tf.io.RaggedFeature(tf.int64)
    if "bytes" in kinds:
        features["bytes"] = tf.io.FixedLenFeature([], tf.string)
    compression = rng.choice([None, "GZIP"])
    paths, next_id = [], 0
    for f in range(rng.randint(1, 3)):
        path = str(folder / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path, options=compression) as w:
            for _ in range(rng.randint(1 if f == 0 else 0, 9)):
                w.write(_example(rng, next_id, kinds, width))
                next_id += 1
        paths.append(path)
    label = rng.choice([None, "id"])
    make = functools.partial(kpipe.data.from_tfrecord, paths, features, label=label, compression_type=compression)
    # plain tf.data doing the same: the same files interleaved one record at a time, each
    # record parsed on its own
    ref = tf.data.Dataset.from_tensor_slices(paths).interleave(
        lambda p: tf.data.TFRecordDataset(p, compression_type=compression or ""),
        cycle_length=min(8, len(paths)),
        block_length=1,
    )

    def parse(record):
        parsed = tf.io.parse_single_example(record, features)
        if label is None:
            return parsed
        parsed = dict(parsed)
        return parsed, parsed.pop(label)

    return make, ref.map(parse), f"from_tfrecord kinds={kinds} files={len(paths)} compression={compression} label={label}"


def _example(rng, i, kinds, width):
    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    feature = {"id": ints([i])}
    if "fixed" in kinds:
        feature["fixed"] = floats([rng.uniform(-9, 9) for _ in range(width)])
    if "seq" in kinds:
        feature["seq"] = ints([rng.randrange(-50, 50) for _ in range(rng.randint(0, 4))])
    if "varlen" in kinds:
        feature["varlen"] = floats([rng.uniform(-9, 9) for _ in range(rng.randint(0, 3))])
    if "ragged" in kinds:
        feature["ragged"] = ints([rng.randrange(100) for _ in range(rng.randint(0, 5))])
    if "bytes" in kinds:
        feature["bytes"] = tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[bytes(rng.randrange(256) for _ in range(rng.randint(0, 6)))])
        )
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _slices(arrays):
    return tf.data.Dataset.from_tensor_slices(arrays)


_SOURCES = {"numpy": (_numpy_case, 0), "hdf5": (_hdf5_case, 1000), "tfrecord": (_tfrecord_case, 2000)}


def _source_case(kind, case, tmp_path):
    make_case, offset = _SOURCES[kind]
    rng = random.Random(offset + case)
    make, ref, what = make_case(rng, tmp_path)
    if not isinstance(ref, tf.data.Dataset):
        ref = _slices(ref)
    return rng, make, ref, what


@pytest.mark.parametrize("case", _cases())
@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_source(kind, case, tmp_path):
    _, make, ref, what = _source_case(kind, case, tmp_path)
    ds = make()
    assert ds.element_spec == ref.element_spec, what
    _assert_same(_elements(ds), _elements(ref), what)


@pytest.mark.parametrize("case", _cases(default=3, slow=20))
@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_source_shards_are_disjoint_and_complete(kind, case, tmp_path):
    rng, make, ref, what = _source_case(kind, case, tmp_path)
    num_shards = rng.randint(2, 7)
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # from_tfrecord: fewer files than shards
        for index in range(num_shards):
            got += _elements(make(num_shards=num_shards, index=index))
    _assert_same(sorted(got), sorted(_elements(ref)), f"{num_shards} shards: {what}")


# -- pipelines ---------------------------------------------------------------------------------


def _map_fn(kind):
    """A TensorFlow per-sample function; the same one runs in the plain tf.data reference."""
    if kind == "scale":
        return lambda x, y: (tf.cast(x, tf.float32) * 0.5 + 1.0, y)
    return lambda x, y: ((x, tf.reduce_sum(tf.cast(x, tf.float64))), y + 1)


def _py_fn(kind):
    """A NumPy per-sample function, made here so that cloudpickle sends it by value."""
    if kind == "affine":

        def affine(x, y):
            return np.asarray(x, np.float64)[..., None] * 3 - np.asarray(y, np.float64), np.asarray(y) % 3

        return affine
    if kind == "noise":

        def noise(x, y):
            import random as pyrandom

            return np.asarray(x, np.float32) + np.random.normal(size=np.shape(x)).astype(np.float32), np.int64(
                pyrandom.randrange(1000)
            )

        return noise

    def flip(x, y):
        return {"x": np.flip(np.atleast_1d(x)).astype(np.int64), "n": np.int32(np.size(x))}, y

    return flip


def _pipeline_case(rng, tmp_path):
    make_case = rng.choice([_numpy_case, _hdf5_case])
    while True:  # pipelines here take (x, y) samples
        make, arrays, what = make_case(rng, tmp_path)
        if isinstance(arrays, tuple) and not isinstance(arrays[0], dict):
            break
    ds = make()
    args = dict(
        batch_size=rng.randint(1, 9),
        drop_remainder=rng.random() < 0.3,
        repeat=rng.choice([False, False, 2]),
        cache=rng.choice([None, None, True, "file"]),
        map_fn=rng.choice([None, None, "scale", "pair"]),
        shuffle=rng.choice([None, None, rng.randint(1, 50)]),
    )
    shards = rng.choice([None, None, 2, 3])
    if args["shuffle"] or shards or rng.random() < 0.5:
        args["seed"] = rng.randrange(2**31)
    return ds, arrays, what, args, shards


_CACHE_FILES = itertools.count()


def _build(ds, args, tmp_path, py_fn=None, workers=0, **extra):
    kw = dict(args)
    if kw["cache"] == "file":
        kw["cache"] = str(tmp_path / f"cache-{next(_CACHE_FILES)}")
    if kw["map_fn"] is not None:
        kw["map_fn"] = _map_fn(kw["map_fn"])
    if py_fn is not None:
        kw.update(py_map_fn=py_fn, workers=workers)
    kw.update(extra)
    return kpipe.data.pipeline(ds, **kw)


def _plain(arrays, args):
    ref = _slices(arrays)
    if args["repeat"]:
        ref = ref.repeat(args["repeat"])
    if args["map_fn"] is not None:
        ref = ref.map(_map_fn(args["map_fn"]))
    return ref.batch(args["batch_size"], drop_remainder=args["drop_remainder"])


def _batches(ds):
    return list(ds.as_numpy_iterator())


@pytest.mark.parametrize("case", _cases())
def test_pipeline_against_plain_tf_data(case, tmp_path):
    rng = random.Random(3000 + case)
    ds, arrays, what, args, shards = _pipeline_case(rng, tmp_path)
    what = f"{what} {args} shards={shards}"
    before = [np.array(a, copy=True) for a in tf.nest.flatten(arrays)]
    _check_pipeline(ds, arrays, what, args, shards, tmp_path)
    # TensorFlow may write an op's output into a block it was handed without a copy: the
    # user's arrays must come out as they went in (from_numpy's blocks are copies of their own)
    for got, want in zip(tf.nest.flatten(arrays), before):
        assert np.array_equal(np.asarray(got), want, equal_nan=want.dtype.kind in "fc"), f"the source's arrays changed: {what}"


def _check_pipeline(ds, arrays, what, args, shards, tmp_path):
    want_batches = _batches(_plain(arrays, args))
    want = _rows(want_batches)
    if shards is None:
        got_ds = _build(ds, args, tmp_path)
        for epoch in range(2):
            got_batches = _batches(got_ds)
            assert [len(_leaves(b)[0]) for b in got_batches] == [len(_leaves(b)[0]) for b in want_batches], what
            got = _rows(got_batches)
            if args["shuffle"]:
                _assert_same(sorted(got), sorted(want), f"epoch {epoch}: {what}")
            else:
                _assert_same(got, want, f"epoch {epoch}: {what}")
        if args.get("seed") is not None:  # a rebuilt pipeline repeats the first, epoch by epoch
            again = _build(ds, args, tmp_path)
            first = _build(ds, args, tmp_path)
            for epoch in range(2):
                _assert_same(_rows(_batches(again)), _rows(_batches(first)), f"rebuilt, epoch {epoch}: {what}")
        return
    # every shard index together: each sample of the whole exactly once (per repeat)
    args = dict(args, drop_remainder=False)
    want = _rows(_batches(_plain(arrays, args)))
    got = []
    for index in range(shards):
        got += _rows(_batches(_build(ds, args, tmp_path, num_shards=shards, index=index)))
    _assert_same(sorted(got), sorted(want), what)


def _serial(fn, batches, seed, iteration):
    """`fn` applied to each sample of `batches` in this process, by the documented rule."""
    out, index = [], 0
    for x, y in batches:
        for i in range(len(x)):
            if seed is not None:
                s = batch_seed(seed, iteration, index)
                random.seed(s)
                np.random.seed(s)
            out.append(_keys(fn(x[i], y[i])))
            index += 1
    return out


def _py_case(rng, tmp_path):
    ds, arrays, what, args, _ = _pipeline_case(rng, tmp_path)
    args["map_fn"] = None  # py_map_fn after a TF map is covered by the pipeline cases' map
    kind = rng.choice(["affine", "flip", "noise"])
    if kind == "noise":
        args["seed"] = rng.randrange(2**31)
    return ds, what, args, kind


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", _cases(default=4, slow=20))
def test_py_map_fn_against_numpy(case, tmp_path):
    rng = random.Random(4000 + case)
    ds, what, args, kind = _py_case(rng, tmp_path)
    workers = rng.choice([0, 1, 2]) if case >= 4 else case % 3
    what = f"{what} {args} py_map_fn={kind} workers={workers}"
    fn = _py_fn(kind)
    upstream = _build(ds, args, tmp_path)
    mapped = _build(ds, args, tmp_path, py_fn=fn, workers=workers)
    for iteration in range(2):
        want = _serial(fn, _batches(upstream), args.get("seed"), iteration)
        got = _rows(_batches(mapped))
        _assert_same(got, want, f"iteration {iteration}: {what}")
    del mapped


_DIGEST_PROGRAM = r"""
import hashlib, sys
import numpy as np
import kpipe.data

def noisy(x, y):
    import random
    return x * np.random.uniform(0.5, 1.5, size=x.shape).astype(np.float32) + random.random(), y

x = np.arange(45 * 3, dtype=np.float32).reshape(45, 3)
for workers in (1, 2):
    ds = kpipe.data.pipeline(kpipe.data.from_numpy(x, np.arange(45) % 4, block_size=4), batch_size=4,
                             py_map_fn=noisy, workers=workers, shuffle=20, seed=7)
    digest = hashlib.sha256()
    for epoch in range(2):
        for xb, yb in ds.as_numpy_iterator():
            digest.update(xb.tobytes()); digest.update(yb.tobytes())
    print(workers, digest.hexdigest(), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_seeded_py_map_fn_is_the_same_in_two_fresh_processes_with_1_and_2_workers():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    digests = []
    for _ in range(2):  # one after the other: two fresh interpreters, each its own workers
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_PROGRAM], env=env, capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line.split() for line in out.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
        assert [w for w, _ in lines] == ["1", "2"], out.stdout
        digests += [d for _, d in lines]
    assert len(set(digests)) == 1, digests
