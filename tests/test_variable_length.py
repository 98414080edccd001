"""Variable-length samples in `ProcessLoader.from_samples` (kpipe/_padding.py,
kpipe/_buckets.py): batches equal to `keras.utils.pad_sequences`, tf.data's `padded_batch`
and `bucket_by_sequence_length` given the same samples in the same order; every sample
once per pass, whatever the worker count; exact resume; shards; lengths given without a
load; bad input named; a collate function run in the worker; Keras trained alike from
kpipe and tf.data, with at most one trace per bucket shape."""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kpipe
from kpipe import _samples
from kpipe.errors import BatchStructureError
from _varlen_datasets import Frames, Pids, Tokens, Watched, pad_right, token_lengths

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

MODES = {"inline": dict(workers=0), "processes": dict(workers=2)}


def _plan(ds, batch_size, **options):
    """The loader's own SampleBatches for these options (its sample order and batches)."""
    seed, shuffle, drop = options.pop("seed", 0), options.pop("shuffle", False), options.pop("drop_remainder", False)
    return _samples.for_loader(ds, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop, has_hooks=False,
                               options=options)


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _read(loader, passes=1):
    return [loader[i] for _ in range(passes) for i in range(len(loader))]


def _labels_ids(batch):
    return [int(j) for j in (batch["labels"] if isinstance(batch, dict) else batch[1])]


def _tf_source(ds, order, dict_samples=False):
    """tf.data over the samples of `ds` in `order`."""
    first = ds[int(order[0])]

    def spec(value, sequence):  # (tf.data pads the axes of unknown size)
        value = np.asarray(value)
        return tf.TensorSpec(([None] + list(value.shape[1:])) if sequence else value.shape, tf.as_dtype(value.dtype))

    if dict_samples:
        sig = {k: spec(v, k != "labels") for k, v in first.items()}
    else:
        sig = tuple(spec(v, i == 0) for i, v in enumerate(first))
    return tf.data.Dataset.from_generator(lambda: (ds[int(j)] for j in order), output_signature=sig)


def _numpy(batch):
    if isinstance(batch, dict):
        return {k: v.numpy() for k, v in batch.items()}
    return tuple(v.numpy() for v in batch)


# ------------------------------------------------------------------ padding parity
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("length, side, too_long, multiple_of", [
    ("longest", "right", "raise", None), ("longest", "left", "raise", 8), (12, "right", "truncate", None),
    (12, "left", "truncate", None)], ids=["longest-right", "longest-left-x8", "fixed-truncate-right", "fixed-truncate-left"])
def test_padding_equals_keras_pad_sequences(mode, length, side, too_long, multiple_of, no_leaks):
    ds = Tokens(token_lengths(23, seed=1))
    padding = kpipe.Padding(length, side=side, too_long=too_long, value=-1, multiple_of=multiple_of)
    with kpipe.ProcessLoader.from_samples(ds, 5, padding=padding, shuffle=True, seed=4, **MODES[mode]) as loader:
        got = _read(loader, passes=2)
    plan = _plan(ds, 5, shuffle=True, seed=4, padding=padding)
    keras_side = "post" if side == "right" else "pre"
    for i, batch in enumerate(got):
        samples = plan.samples((i // len(plan), i % len(plan), 4))
        rows = [ds[int(j)][0] for j in samples]
        longest = max(len(r) for r in rows) if length == "longest" else length
        maxlen = -(-longest // multiple_of) * multiple_of if multiple_of else longest
        want = keras.utils.pad_sequences(rows, maxlen=maxlen, dtype="int32", padding=keras_side, truncating=keras_side,
                                         value=-1)
        assert _equal(batch[0], want), i
        assert _labels_ids(batch) == [j % 2 for j in samples]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dict_samples_equal_tf_padded_batch_with_a_pad_value_per_leaf_and_a_mask(mode, no_leaks):
    ds = Tokens(token_lengths(19, seed=2), dict_samples=True, mask=True)
    padding = kpipe.Padding(value={"input_ids": 0, "attention_mask": 0}, lengths="lengths")
    with kpipe.ProcessLoader.from_samples(ds, 4, padding=padding, **MODES[mode]) as loader:
        got = _read(loader)
    want = [_numpy(b) for b in _tf_source(ds, np.arange(len(ds)), dict_samples=True).padded_batch(
        4, padding_values={"input_ids": 0, "attention_mask": 0, "labels": 0})]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        w["lengths"] = w["attention_mask"].sum(axis=1).astype(np.int32)
        assert _equal(g, w)
    # the mask kpipe makes equals the one the dataset gave
    made = kpipe.Padding(mask="attention_mask", mask_dtype="int32")
    with kpipe.ProcessLoader.from_samples(Tokens(ds.lengths, dict_samples=True), 4, padding=made, **MODES[mode]) as loader:
        for i, g in enumerate(got):
            assert _equal({k: v for k, v in g.items() if k != "lengths"}, loader[i])


def test_float_frames_pad_along_the_time_axis_like_padded_batch(no_leaks):
    ds = Frames(token_lengths(11, seed=3, low=1))
    with kpipe.ProcessLoader.from_samples(ds, 3, padding=kpipe.Padding(value=-2.5, side="left"), workers=1) as loader:
        got = _read(loader)
    # tf.data pads on the right only: compare flipped in time
    flipped = [(x[::-1], y) for x, y in (ds[j] for j in range(len(ds)))]
    want = tf.data.Dataset.from_generator(lambda: iter(flipped), output_signature=(
        tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([], tf.float32))).padded_batch(3, padding_values=(-2.5, 0.0))
    for g, (x, y) in zip(got, want):
        assert _equal((g[0][:, ::-1], g[1]), (x.numpy(), y.numpy()))


def test_padded_batches_and_their_mask_are_written_in_the_slot_without_a_copy():
    from kpipe._engine import _alloc, _shm

    ds = Tokens([3, 7, 0, 5], dict_samples=True)
    batches = _samples.SampleBatches(ds, 4, shuffle=False, seed=0, drop_remainder=False,
                                     padding=kpipe.Padding(mask="mask", lengths="n", multiple_of=4))
    segment = _shm.Segment.create(0)
    try:
        alloc = _alloc.begin(segment)  # what a worker does around __getitem__
        try:
            batch = batches[(0, 0)]
        finally:
            _alloc.end()
        # every array in the slot: handed over as it is, no padded temporary copied in
        offsets = {key: alloc.offset_of(leaf) for key, leaf in batch.items()}
        assert None not in offsets.values(), offsets
        # and nothing else was allocated there: the slot ends with the last of them
        assert alloc.used == max(offsets[k] + batch[k].nbytes for k in batch)
        assert batch["input_ids"].shape == (4, 8) and batch["n"].tolist() == [3, 7, 0, 5]
        del batch, alloc
    finally:
        segment.close()


@pytest.mark.parametrize("padding, lengths, streamed", [
    (kpipe.Padding(8, too_long="truncate"), False, True), (kpipe.Padding(), True, True), (kpipe.Padding(), False, False)],
    ids=["fixed-length", "longest-lengths-given", "longest-measured-in-the-batch"])
def test_samples_are_written_as_read_where_the_padded_length_is_known_before(padding, lengths, streamed):
    ds = Watched([3, 9, 4, 6])
    given = dict(lengths=ds.lengths) if lengths else {}
    batch = _plan(ds, 4, padding=padding, **given)[(0, 0)]
    assert ds.alive_at_load == ([[]] * 4 if streamed else [[], [0], [0, 1], [0, 1, 2]])
    assert batch[0].shape == (4, 8 if padding.length == 8 else 9)


def test_workers_do_not_import_tensorflow_for_padded_and_bucketed_batches(no_leaks):
    ds = Tokens(token_lengths(12, seed=14), dict_samples=True)
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=kpipe.Buckets([10]), padding=kpipe.Padding(mask="mask"),
                                          workers=1) as loader:
        pid = loader.stats()["pids"][0]
        loader[0]
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    assert "tensorflow" not in maps and "_pywrap" not in maps and os.getpid() != pid


# ------------------------------------------------------------------ bucket parity
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("pad_to_boundary, drop", [(False, False), (True, True)], ids=["longest", "boundary-drop"])
def test_buckets_equal_tf_bucket_by_sequence_length(mode, pad_to_boundary, drop, no_leaks):
    bounds, sizes = [5, 10, 20], [4, 3, 5, 2]
    ds = Tokens(token_lengths(57, seed=5, high=20 if pad_to_boundary else 30))
    buckets = kpipe.Buckets(bounds, sizes, pad_to_boundary=pad_to_boundary)
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=1, drop_remainder=drop,
                                          **MODES[mode]) as loader:
        n = len(loader)
        got = _read(loader, passes=2)
    plan = _plan(ds, 4, shuffle=True, seed=1, drop_remainder=drop, buckets=buckets)
    for pass_ in range(2):
        order = plan.order(pass_, 1)
        source = _tf_source(ds, order)
        want = source.bucket_by_sequence_length(lambda x, y: tf.shape(x)[0], bounds, sizes, drop_remainder=drop,
                                                pad_to_bucket_boundary=pad_to_boundary)
        old = source.apply(tf.data.experimental.bucket_by_sequence_length(
            lambda x, y: tf.shape(x)[0], bounds, sizes, drop_remainder=drop, pad_to_bucket_boundary=pad_to_boundary))
        want, old = [_numpy(b) for b in want], [_numpy(b) for b in old]
        assert len(want) == n
        assert _equal(got[pass_ * n:(pass_ + 1) * n], want) and _equal(want, old), pass_


# ------------------------------------------------------------------ every sample once, any worker count
@pytest.mark.parametrize("buckets", [kpipe.Buckets([6, 12], [3, 4, 2]), kpipe.Buckets(sort_within=3)], ids=["bounds", "sorted"])
def test_each_sample_once_per_pass_and_the_same_batches_whatever_the_worker_count(buckets, no_leaks):
    ds = Tokens(token_lengths(40, seed=6), index_labels=True)

    def read(**mode):
        with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=9, **mode) as loader:
            sizes = [len(loader)]
            out = []
            for _ in range(3):
                out.append(_read(loader))
                sizes.append(len(loader))
            return out, sizes

    inline, sizes = read(workers=0)
    for batches in (read(workers=1)[0], read(workers=2)[0]):
        assert all(_equal(a, b) for p, q in zip(inline, batches) for a, b in zip(p, q))
    for batches in inline:
        assert sorted(j for b in batches for j in _labels_ids(b)) == list(range(40))
    assert len(set(sizes)) == 1
    plan = _plan(ds, 4, shuffle=True, seed=9, buckets=buckets)
    for pass_ in range(3):
        seen = sorted(int(j) for b in range(len(plan)) for j in plan.samples((pass_, b, 9)))
        assert seen == list(range(40))
    assert [plan.samples((0, b, 9)).tolist() for b in range(3)] != [plan.samples((1, b, 9)).tolist() for b in range(3)]
    if buckets.sort_within:  # lengths sorted within each window of 3 batches: less padding than plain batches
        plain = _plan(ds, 4, shuffle=True, seed=9, padding=kpipe.Padding())
        waste = [sum(max(ds.lengths[s]) * len(s) - sum(ds.lengths[s]) for s in (p.samples((0, b, 9)) for b in range(len(p))))
                 for p in (plan, plain)]
        assert waste[0] < waste[1]


def test_state_mid_pass_resumes_the_same_bucketed_batches_with_other_workers(no_leaks):
    ds = Tokens(token_lengths(33, seed=7))
    buckets = kpipe.Buckets([8, 16], [3, 4, 2])
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=5, workers=2) as loader:
        full = _read(loader, passes=2)
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=5, workers=2) as loader:
        n = len(loader)
        head = [loader[i] for i in range(4)]
        state = loader.state()
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=5, workers=1) as loader:
        loader.restore(state)
        rest = [loader[i] for i in range(4, n)] + _read(loader)
    assert _equal(head + rest, full)


def test_shards_read_disjoint_bucketed_batches_covering_every_sample(no_leaks):
    ds = Tokens(token_lengths(29, seed=8), index_labels=True)
    buckets, seen = kpipe.Buckets([10], [4, 3]), []
    for shard in range(3):
        with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, shuffle=True, seed=2, workers=0, num_shards=3,
                                              shard_index=shard) as loader:
            seen += [j for b in _read(loader) for j in _labels_ids(b)]
    assert sorted(seen) == list(range(29))


def test_as_dataset_takes_batches_whose_padded_length_changes_after_the_first_two(no_leaks):
    ds = Tokens([5, 5, 5, 5, 9, 3, 2, 7])  # batches 0 and 1 both (2, 5)
    with kpipe.ProcessLoader.from_samples(ds, 2, padding=kpipe.Padding(), workers=1) as loader:
        assert [x.shape for x, _ in loader.as_dataset()] == [(2, 5), (2, 5), (2, 9), (2, 7)]


# ------------------------------------------------------------------ lengths
def test_given_lengths_cost_no_load_and_otherwise_each_sample_is_read_once_when_built():
    lengths = token_lengths(30, seed=9)
    for given in (lengths, list(lengths), lambda j: int(lengths[j])):
        ds = Tokens(lengths)
        plan = _plan(ds, 4, buckets=kpipe.Buckets([10, 20]), lengths=given)
        assert ds.reads == 0 and len(plan) == sum(-(-c // 4) for c in np.bincount(np.searchsorted([10, 20], lengths, "right")))
    ds = Tokens(lengths)
    measured = _plan(ds, 4, buckets=kpipe.Buckets([10, 20]))
    assert ds.reads == 30 and np.array_equal(measured.lengths, lengths)


def test_lengths_that_disagree_with_the_samples_are_named(no_leaks):
    lengths = token_lengths(12, seed=10, low=1)
    wrong = lengths.copy()
    wrong[5] += 1
    with kpipe.ProcessLoader.from_samples(Tokens(lengths), 4, lengths=wrong, padding=kpipe.Padding(), workers=1) as loader:
        loader[0]
        with pytest.raises(BatchStructureError, match=rf"Sample 5 of `Tokens` has sample\[0\] of length {lengths[5]}, but "
                                                      rf"`lengths` gave {wrong[5]} for it"):
            loader[1]
    with pytest.raises(ValueError, match=r"`lengths` must give one int >= 0 per sample \(12 for `Tokens`\).*shape \(3,\)"):
        _plan(Tokens(lengths), 4, lengths=[1, 2, 3], padding=kpipe.Padding())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("ds, message", [
    (Tokens([3, 4, 5, 6], bad={2: "rank"}), r"Sample 2 of `Tokens` has sample\[0\] with shape \(5, 1\) and dtype int32, "
                                            r"but sample 0 of the same batch had \(3,\) and int32"),
    (Tokens([3, 4, 5, 6], bad={3: "dtype"}), r"Sample 3 of `Tokens` has sample\[0\] with shape \(6,\) and dtype int64, "
                                             r"but sample 0 of the same batch had \(3,\) and int32"),
    (Frames([3, 4, 5, 6], bad={1: "inner"}), r"Sample 1 of `Frames` has sample\[0\] with shape \(4, 3\) .* sample 0 of the "
                                             r"same batch had \(3, 2\)"),
], ids=["rank", "dtype", "inner-axis"])
def test_samples_that_differ_in_rank_dtype_or_inner_shape_name_both(ds, message, no_leaks):
    with kpipe.ProcessLoader.from_samples(ds, 4, padding=kpipe.Padding(), workers=1) as loader:
        with pytest.raises(BatchStructureError, match=message):
            loader[0]


def test_too_long_samples_raise_are_dropped_and_counted_or_are_truncated(no_leaks):
    lengths = np.array([3, 9, 4, 12, 2, 5, 11])
    # raise: named in the worker (lengths unknown) or when the loader is built (lengths known)
    with kpipe.ProcessLoader.from_samples(Tokens(lengths), 4, padding=kpipe.Padding(8), workers=1) as loader:
        with pytest.raises(BatchStructureError, match=r"Sample 1 of `Tokens` has sample\[0\] of length 9, longer than "
                                                      r"the padded length 8.*too_long='truncate'"):
            loader[0]
    with pytest.raises(BatchStructureError, match=r"Sample 1 of `Tokens` has length 9, longer than the padded length 8 "
                                                  r"\(3 of 7 samples are\)"):
        kpipe.ProcessLoader.from_samples(Tokens(lengths), 4, padding=kpipe.Padding(8), lengths=lengths, workers=0)
    # drop: measured, left out of every pass, counted by a warning
    with pytest.warns(UserWarning, match=r"3 of 7 samples of `Tokens` are longer than 8 and are left out of every pass"):
        loader = kpipe.ProcessLoader.from_samples(Tokens(lengths), 2, padding=kpipe.Padding(8, too_long="drop"),
                                                  shuffle=True, seed=0, workers=2)
    with loader:
        assert len(loader) == 2
        for _ in range(2):
            batches = _read(loader)
            assert sorted(len(np.trim_zeros(r)) for b in batches for r in b[0]) == [2, 3, 4, 5]
            assert all(b[0].shape[1] == 8 for b in batches)
    # truncate: cut to 8 on the padding side
    with kpipe.ProcessLoader.from_samples(Tokens(lengths), 7, padding=kpipe.Padding(8, too_long="truncate"),
                                          workers=0) as loader:
        ids = loader[0][0]
    assert ids.shape == (7, 8) and np.array_equal(ids[3], Tokens(lengths).ids(3)[:8])
    # the largest bucket with pad_to_boundary is a limit too
    with pytest.warns(UserWarning, match=r"2 of 7 samples .* longer than 9"):
        plan = _plan(Tokens(lengths), 2, buckets=kpipe.Buckets([5, 10], pad_to_boundary=True),
                     padding=kpipe.Padding(too_long="drop"))
    assert sorted(plan.pool.tolist()) == [0, 1, 2, 4, 5]


def test_empty_sequences_pad_fully_and_mask_nothing(no_leaks):
    ds = Tokens([0, 3, 0, 0], dict_samples=True)
    with kpipe.ProcessLoader.from_samples(ds, 2, padding=kpipe.Padding(mask="mask", lengths="n"), workers=1) as loader:
        first, second = loader[0], loader[1]
    assert first["input_ids"].shape == (2, 3) and first["mask"].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert second["input_ids"].shape == (2, 0) and second["n"].tolist() == [0, 0]
    with kpipe.ProcessLoader.from_samples(ds, 2, buckets=kpipe.Buckets([1], [3, 1]), workers=0) as loader:
        assert [b["input_ids"].shape for b in _read(loader)] == [(1, 3), (3, 0)]  # (bucket 1 fills first)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(padding=kpipe.Padding(mask="labels")), ValueError, "would add the key 'labels', which samples of `Tokens` have"),
    (dict(padding=kpipe.Padding(value={"input_ids": 300}), workers=0), ValueError,
     "The pad value 300 of sample['input_ids'] does not fit its dtype"),
    (dict(padding=kpipe.Padding(leaves=["ids"])), ValueError, "`Padding(leaves=...)` names ['ids']"),
    (dict(padding="longest"), TypeError, "`padding` must be a kpipe.Padding or None. Received: padding='longest'"),
    (dict(padding=kpipe.Padding(), collate=pad_right), ValueError, "Give `padding` or `collate`, not both"),
])
def test_bad_options_are_named(kwargs, error, message, no_leaks):
    ds = Tokens([3, 4, 5], dict_samples=True, vocab=120)
    ds.ids = lambda j: np.arange(3 + j, dtype=np.int8)  # (int8 ids: 300 does not fit)
    kwargs.setdefault("workers", 0)
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)").replace(
            "]", r"\]").replace(".", r"\.")):
        with kpipe.ProcessLoader.from_samples(ds, 2, **kwargs) as loader:
            loader[0]


@pytest.mark.parametrize("args, message", [
    (dict(length=-1), "`length` must be 'longest' or an int >= 0. Received: length=-1"),
    (dict(side="pre"), "`side` must be 'right' or 'left'. Received: side='pre'"),
    (dict(too_long="cut"), "`too_long` must be one of"),
    (dict(multiple_of=0), "`multiple_of` must be None or an int >= 1. Received: multiple_of=0"),
])
def test_bad_padding_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kpipe.Padding(**args)


@pytest.mark.parametrize("args, message", [
    (dict(), "either `boundaries` or `sort_within`"),
    (dict(boundaries=[5, 3]), "`boundaries` must be increasing ints >= 1. Received: boundaries=[5, 3]"),
    (dict(boundaries=[5], batch_sizes=[2]), "`batch_sizes` must be 2 ints >= 1"),
    (dict(sort_within=0), "`sort_within` must be an int >= 1"),
])
def test_bad_bucket_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        kpipe.Buckets(**args)


# ------------------------------------------------------------------ collate
def test_a_collate_function_runs_in_the_worker_and_its_batch_is_handed_over(no_leaks):
    ds = Pids(token_lengths(10, seed=11, low=1))
    with kpipe.ProcessLoader.from_samples(ds, 4, collate=pad_right, buckets=kpipe.Buckets([10], [4, 2]),
                                          workers=1) as loader:
        batches = _read(loader)
    plan = _plan(Pids(ds.lengths), 4, collate=pad_right, buckets=kpipe.Buckets([10], [4, 2]))
    for i, (ids, pids, collated_by) in enumerate(batches):
        want = pad_right([ds[int(j)] for j in plan.samples(i)])[0]
        assert _equal(ids, want)
        assert set(pids.tolist()) == set(collated_by.tolist()) and os.getpid() not in set(pids.tolist())


# ------------------------------------------------------------------ Keras
def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(50, 4, mask_zero=True)(inputs)
    x = _Traces()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


class _Traces(keras.layers.Layer):
    """Identity; counts its calls -- in a `tf.function` step, one per trace."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.supports_masking = True

    def call(self, x):
        type(self).calls += 1
        return x


def test_embedding_mask_zero_trains_the_same_weights_from_kpipe_and_tf_data_with_one_trace_per_bucket(no_leaks):
    lengths = token_lengths(48, seed=12, low=1, high=16)
    bounds, sizes = [6, 11, 16], [4, 4, 4, 4]
    ds = Tokens(lengths, column_targets=True)
    buckets = kpipe.Buckets(bounds, sizes, pad_to_boundary=True)
    source = _tf_source(ds, np.arange(len(ds))).bucket_by_sequence_length(
        lambda x, y: tf.shape(x)[0], bounds, sizes, pad_to_bucket_boundary=True, drop_remainder=True)
    source = source.apply(tf.data.experimental.assert_cardinality(len(_plan(ds, 4, buckets=buckets, drop_remainder=True))))
    plain = _model()
    plain.fit(source, epochs=2, verbose=0, shuffle=False)
    got = _model()
    _Traces.calls = 0
    with kpipe.ProcessLoader.from_samples(ds, 4, buckets=buckets, drop_remainder=True, workers=2) as loader:
        shapes = {loader[i][0].shape for i in range(len(loader))}
        got.fit(loader, epochs=2, verbose=0, shuffle=False)
    assert len(shapes) == 3  # one shape per bucket used (the partial batches dropped)
    print("traces:", _Traces.calls, "shapes:", sorted(shapes))
    assert 1 <= _Traces.calls <= len(shapes), _Traces.calls
    for a, b in zip(got.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_masking_trains_the_same_weights_from_kpipe_padding_and_tf_padded_batch(no_leaks):
    ds = Frames(token_lengths(24, seed=13, low=1, high=12))

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, 2))
        x = keras.layers.Masking(0.0)(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        m = keras.Model(inputs, keras.layers.Dense(1)(x))
        m.compile(keras.optimizers.SGD(0.01), "mse")
        return m

    source = _tf_source(ds, np.arange(len(ds))).map(lambda x, y: (x, y[None])).padded_batch(6)
    plain = model()
    plain.fit(source.apply(tf.data.experimental.assert_cardinality(4)), epochs=2, verbose=0, shuffle=False)
    got = model()
    targets = Frames(ds.lengths, column_targets=True)
    with kpipe.ProcessLoader.from_samples(targets, 6, padding=kpipe.Padding(), workers=1) as loader:
        got.fit(loader, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(got.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)



def test_fit_takes_padded_batches_whose_length_changes_after_the_first_two(no_leaks):
    # Keras < 3.7 reads kpipe's loaders through the adapter's from_generator, whose spec
    # was merged from batches 0 and 1 only: both (2, 5) here, and batch 2 (2, 9) failed.
    ds = Frames([5, 5, 5, 5, 9, 3, 2, 7], column_targets=True)

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, 2))
        m = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(inputs)))
        m.compile(keras.optimizers.SGD(0.01), "mse")
        return m

    with kpipe.ProcessLoader.from_samples(ds, 2, padding=kpipe.Padding(), workers=1) as loader:
        batches = [tuple(np.array(a) for a in loader[i]) for i in range(len(loader))]
        assert [x.shape[:2] for x, _ in batches] == [(2, 5), (2, 5), (2, 9), (2, 7)]
        got = model()
        history = got.fit(loader, epochs=2, verbose=0, shuffle=False)
    # (plain Keras's own PyDataset adapter merges its spec from two batches too: the same
    # batches go to it as a tf.data dataset of unknown inner sizes)
    specs = tuple(tf.TensorSpec((None,) * a.ndim, tf.as_dtype(a.dtype)) for a in batches[0])
    plain = model()
    plain.fit(tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=specs).apply(
        tf.data.experimental.assert_cardinality(len(batches))), epochs=2, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 2
    for a, b in zip(got.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
