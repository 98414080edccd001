"""`kpipe.Padding`: how `ProcessLoader.from_samples` pads variable-length samples into
one batch, written straight into the batch's shared-memory slot.

NOTE [ Padding into the slot ]
------------------------------
A padded batch is built where a stacked one is (the NOTE in `kpipe/_samples.py`): the
worker reads the batch's samples, then for each leaf allocates the batch array at its
final padded shape with `kpipe.empty` -- in a process worker, the batch's own slot --
and writes each sample's values and the pad value into its row once:

    L_k        = target length of leaf k: the batch's longest (`length="longest"`), a
                 fixed `length`, or the bucket's boundary - 1 (`Buckets(pad_to_boundary)`),
                 rounded up to `multiple_of`
    out_k      = kpipe.empty((rows, L_k) + inner shape, dtype)
    right:     out_k[r, :n] = sample[:n];  out_k[r, n:] = value
    left:      out_k[r, L-n:] = sample[-n:]; out_k[r, :L-n] = value

except that an `out_k` of at most `_PREFILL_BYTES` (64 KiB: 32 rows of ~500 int32 tokens)
is filled with the value in one call first (`out_k[...] = value`, in the core's cache)
and its rows then get only their values: one NumPy call per row instead of two, ~0.3 us
a sample less; a larger one (waveforms) is written once, as above.
No padded temporary is made per sample or per batch (`keras.utils.pad_sequences` and
`padded_batch` fill a fresh array, then it is copied into shared memory). Where the
padded lengths are known before the samples are read -- a fixed `length`, a bucket's
boundary, or the lengths the user gave with one padded leaf -- each sample is written as
it is read and dropped before the next (its memory then reused for it, as the stacked
path does); otherwise the batch's samples are held until its longest is known, as a
collate function holds them.
A leaf is padded along its first axis (a sequence's time axis); its other axes, its rank
and its dtype must agree between the samples of a batch (a named error otherwise). The
mask (`mask=`) and lengths (`lengths=`) outputs are two more arrays in the slot, added to
the sample's dict (or to its inputs' dict: `(inputs, targets)` with `inputs` a dict). A
batch's arrays, these included, are carved out of one `kpipe.empty` block (`_carve`): one
allocation in the slot per batch rather than one per array.
"""

import math
import numbers

import numpy as np

from kpipe._engine import _alloc, _tree
from kpipe.errors import BatchStructureError

_TOO_LONG = ("raise", "drop", "truncate")
_PREFILL_BYTES = 1 << 16  # a padded batch array up to this size is filled with its pad first (see Batch)
_ndarray, _generic = np.ndarray, np.generic


class Padding:
    """How `ProcessLoader.from_samples(..., padding=kpipe.Padding(...))` pads the
    variable-length leaves of a batch's samples (along each leaf's first axis), as
    `keras.utils.pad_sequences`, tf.data's `padded_batch` and PyTorch's `pad_sequence` do.

    Args:
        length: "longest" (the batch's longest sample, per leaf) or an int: every batch
            padded (and samples longer cut or refused, see `too_long`) to that length.
            Defaults to "longest".
        multiple_of: Round each padded length up to a multiple of this int (fewer batch
            shapes: fewer `tf.function` traces; tensor-core friendly). Defaults to None.
        value: The pad value: a number for every padded leaf, or a dict of numbers by
            leaf name (a dict sample's key, a tuple sample's index, or a leaf path such as
            `"sample[0]['ids']"`); leaves it does not name get 0. Defaults to 0.
        side: "right" (pad after, keep the head when truncating: Keras "post") or
            "left" (pad before, keep the tail: Keras "pre"). Defaults to "right".
        leaves: The leaf names to pad (see `value`); None: every leaf of rank >= 1 of
            a dict or array sample, and of the inputs `x` of an `(x, y[, w])` tuple
            sample (a `(1,)` target is not stretched to a fixed length; name `1` to pad
            per-token targets). Leaves not padded must have one shape in a batch.
            Defaults to None.
        mask: A key to add to the sample's dict (or its inputs' dict) holding a
            `(rows, length)` mask, 1 on real elements and 0 on padding, of the first
            padded leaf. Defaults to None (no mask).
        lengths: A key to add likewise holding each row's real length (int32).
            Defaults to None.
        mask_dtype: The mask's dtype. Defaults to "int32".
        too_long: For a sample longer than a fixed `length` (or than the largest bucket
            with `pad_to_boundary`): "raise" (a named error), "drop" (left out of every
            pass, counted by a warning when the loader is built; needs the lengths before
            batching, see `from_samples`'s `lengths`) or "truncate" (cut on `side`).
            Defaults to "raise".

    Example:

    >>> import numpy as np, kpipe
    >>> class Tokens:
    ...     def __len__(self):
    ...         return 4
    ...     def __getitem__(self, j):
    ...         return {"ids": np.arange(1, j + 2), "label": j}
    >>> padding = kpipe.Padding(multiple_of=4, mask="mask")
    >>> with kpipe.ProcessLoader.from_samples(Tokens(), 2, padding=padding, workers=1) as loader:
    ...     batch = loader[1]
    >>> batch["ids"].tolist(), batch["mask"].tolist()
    ([[1, 2, 3, 0], [1, 2, 3, 4]], [[1, 1, 1, 0], [1, 1, 1, 1]])
    """

    def __init__(self, length="longest", *, multiple_of=None, value=0, side="right", leaves=None, mask=None,
                 lengths=None, mask_dtype="int32", too_long="raise"):
        if not (length == "longest" if isinstance(length, str) else _is_int(length) and length >= 0):
            raise ValueError(f"`length` must be 'longest' or an int >= 0. Received: length={length!r}.")
        if multiple_of is not None and not (_is_int(multiple_of) and multiple_of >= 1):
            raise ValueError(f"`multiple_of` must be None or an int >= 1. Received: multiple_of={multiple_of!r}.")
        if side not in ("right", "left"):
            raise ValueError(f"`side` must be 'right' or 'left'. Received: side={side!r}.")
        if too_long not in _TOO_LONG:
            raise ValueError(f"`too_long` must be one of {_TOO_LONG}. Received: too_long={too_long!r}.")
        values = value.values() if isinstance(value, dict) else [value]
        if not all(isinstance(v, numbers.Number) for v in values):
            raise TypeError(f"`value` must be a number or a dict of numbers by leaf name. Received: value={value!r}.")
        for name, key in (("mask", mask), ("lengths", lengths)):
            if key is not None and not isinstance(key, str):
                raise TypeError(f"`{name}` must be None or a str (the key to add). Received: {name}={key!r}.")
        if mask is not None and mask == lengths:
            raise ValueError(f"`mask` and `lengths` must be different keys. Received: both {mask!r}.")
        self.length = length if isinstance(length, str) else int(length)
        self.multiple_of = None if multiple_of is None else int(multiple_of)
        self.value, self.side, self.mask, self.lengths = value, side, mask, lengths
        self.leaves = None if leaves is None else list(leaves)
        self.mask_dtype = np.dtype(mask_dtype)
        self.too_long = too_long

    def __repr__(self):
        args = {k: v for k, v in vars(self).items() if k != "mask_dtype"}
        return f"Padding({', '.join(f'{k}={v!r}' for k, v in args.items())})"

    def max_length(self, bucket_limit=None):
        """The longest a sample may be before `too_long` applies (None: no limit)."""
        return self.length if isinstance(self.length, int) else bucket_limit

    def target(self, longest, bucket_limit=None):
        """The padded length of a leaf whose longest sample in the batch is `longest`."""
        limit = self.max_length(bucket_limit)
        n = limit if limit is not None else longest
        if self.multiple_of:
            n = -(-n // self.multiple_of) * self.multiple_of
        return n


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def leaf_names(treedef):
    """Per leaf of `treedef`: the names that pick it in `Padding` (`value`, `leaves`): its
    path ("sample[0]['ids']") and its top-level key or index."""
    out = []

    def walk(td, path, top):
        if td[0] == "leaf":
            out.append({path} | ({top} if top is not None else set()))
        elif td[0] == "dict":
            for k, c in zip(td[1], td[2]):
                walk(c, f"{path}[{k!r}]", k if top is None else top)
        elif td[0] in ("tuple", "list"):
            for i, c in enumerate(td[1]):
                walk(c, f"{path}[{i}]", i if top is None else top)

    def root(td):
        if td[0] == "leaf":
            out.append({"sample"})
        else:
            walk(td, "sample", None)

    root(treedef)
    return out


class Plan:
    """The padding of batches of one structure (`treedef`, from a batch's first sample):
    which leaves are padded, their pad values, the leaf that gives a sample's length."""

    def __init__(self, padding, treedef, first_leaves, dataset_name):
        self.padding, self.treedef, self.name = padding, treedef, dataset_name
        names = leaf_names(treedef)
        self.paths = _tree.leaf_paths(treedef, "sample")
        if padding.leaves is None:  # (x, y[, w]): x's leaves; a dict or an array: all
            inputs = [0 in n or n == {"sample"} for n in names] if treedef[0] in ("tuple", "list") else None
            self.padded = [leaf.ndim >= 1 and (inputs is None or inputs[k]) for k, leaf in enumerate(first_leaves)]
        else:
            known = set().union(*names) if names else set()
            unknown = [n for n in padding.leaves if n not in known]
            if unknown:
                raise ValueError(f"`Padding(leaves=...)` names {unknown!r}, which samples of `{dataset_name}` do not "
                                 f"have. Their leaves: {self.paths}. Name them by key, index or path.")
            self.padded = [bool(n & set(padding.leaves)) for n in names]
        for k, leaf in enumerate(first_leaves):
            if self.padded[k] and leaf.ndim == 0:
                raise BatchStructureError(
                    f"{self.paths[k]} of `{dataset_name}` is a scalar: there is no axis to pad. Leave it out of "
                    "`Padding(leaves=...)`.")
        values = padding.value if isinstance(padding.value, dict) else None
        self.values = []
        for k, leaf in enumerate(first_leaves):
            v = padding.value if values is None else next((values[n] for n in names[k] if n in values), 0)
            pad = np.asarray(v).astype(leaf.dtype) if self.padded[k] else None
            if pad is not None and pad.item() != v:
                raise ValueError(f"The pad value {v!r} of {self.paths[k]} does not fit its dtype {leaf.dtype}. Give a "
                                 "value the dtype holds in `Padding(value=...)`.")
            self.values.append(pad)
        self.length_leaf = next((k for k, p in enumerate(self.padded) if p), None)
        if self.length_leaf is None:
            raise BatchStructureError(f"`Padding` pads no leaf of `{dataset_name}`'s samples ({self.paths}): each is a "
                                      "scalar or left out by `leaves=`.")
        if padding.mask is not None or padding.lengths is not None:
            keys = _extra_dict(treedef, dataset_name)[1]
            taken = [k for k in (padding.mask, padding.lengths) if k in keys]
            if taken:
                raise ValueError(f"`Padding` would add the key {taken[0]!r}, which samples of `{dataset_name}` have "
                                 "already. Give `mask`/`lengths` another key.")

    def targets(self, bucket_limit=None, rows=None, given=None):
        """Per leaf, the padded length of this batch's leaf (None for a leaf not padded),
        or None when it is not known before the samples are read: known for a fixed
        length or a bucket's boundary, from the samples (`rows`), or from the lengths the
        user gave (`given`) where a single leaf is padded."""
        fixed = self.padding.max_length(bucket_limit)
        out = []
        for k, padded in enumerate(self.padded):
            if not padded:
                out.append(None)
                continue
            if fixed is not None:
                longest = fixed
            elif rows is not None:
                longest = max(row[k].shape[0] for row in rows)
            elif given is not None and sum(self.padded) == 1:
                longest = max(given)
            else:
                return None
            out.append(self.padding.target(longest, bucket_limit))
        return out

    def batch(self, size, first, first_leaves, targets, bucket_limit=None):
        """A `Batch` of `size` rows whose first sample (index `first`) has these leaves."""
        return Batch(self, size, first, first_leaves, targets, self.padding.max_length(bucket_limit))

    def fill(self, samples, rows, bucket_limit=None, given_lengths=None):
        """The batch of `rows` (each a list of leaves, of sample indices `samples`),
        padded into arrays allocated with `kpipe.empty` (the slot). `given_lengths`: the
        lengths the user gave for these samples, checked against them."""
        batch = self.batch(len(rows), samples[0], rows[0], self.targets(bucket_limit, rows), bucket_limit)
        batch.read(0, samples, lambda _, row=iter(rows).__next__: row(), _same, given_lengths)
        return batch.finish()


class Batch:
    """One padded batch being written: its arrays allocated at their final shapes with
    `kpipe.empty` (the slot), each sample written into its row by `put` as it is read.

    `put` runs once per sample, so what it needs per leaf is worked out here once (the
    output array, padded length, expected dtype and shape, pad value as a Python number,
    whether it gives the row's length, the length past which a sample is cut or refused)
    and unpadded leaves (labels) are gathered into a list and written with one NumPy call
    by `finish`. A padded leaf's batch array of at most `_PREFILL_BYTES` is filled with
    its pad value in one call here (it is in the core's cache: cheaper than one write of
    the pad per row), so `put` writes only the sample's values into it; a larger one
    (waveforms) gets the pad written row by row after the values (its bytes written
    once). The per-sample cost is then the writes themselves, as in a hand-written
    padding loop (`scripts/bench_varlen.py`)."""

    def __init__(self, plan, size, first, first_leaves, targets, limit):
        self.plan, self.first, self.targets, self.limit = plan, first, targets, limit
        self.refs = [(leaf.shape, leaf.dtype) for leaf in first_leaves]
        p = plan.padding
        shapes = [((size, t) + shape[1:] if t is not None else (size,) + shape, dtype)
                  for t, (shape, dtype) in zip(targets, self.refs)]
        extra = [((size, targets[plan.length_leaf]), p.mask_dtype)] if p.mask is not None else []
        extra += [((size,), np.dtype(np.int32))] if p.lengths is not None else []
        self.out = _carve(shapes + extra)
        self.extra = self.out[len(shapes):]  # (the mask and lengths arrays, filled by finish)
        del self.out[len(shapes):]
        self.used = [0] * size  # the length leaf's real length per row
        truncate = plan.padding.too_long == "truncate" or limit is None
        self.right = plan.padding.side == "right"
        # per leaf: (index, output, padded length or None, dtype, rank, checked shape, pad value or None when
        # the output is filled with it already, gives the length, longest kept as it is, cut beyond it,
        # unpadded leaves' rows or None, the NumPy scalar type whose values need no check or None)
        self.cols = []
        for k, (out, t, (shape, dtype)) in enumerate(zip(self.out, targets, self.refs)):
            pad = None if plan.values[k] is None else plan.values[k].item()
            if t is not None and out.nbytes <= _PREFILL_BYTES:
                out.fill(pad)
                pad = None
            cap = None if t is None else t if truncate else min(t, limit)
            self.cols.append((k, out, t, dtype, len(shape), shape[1:] if t is not None else shape, pad,
                              k == plan.length_leaf, cap, truncate, [None] * size if t is None else None,
                              _scalar_type(shape, dtype)))

    def put(self, r, j, leaves, given=None):
        """Writes sample `j`'s `leaves` into row `r` (its length checked against `given`)."""
        self.read(r, [j], lambda _: leaves, _same, None if given is None else [given])

    def read(self, start, samples, load, leaves_of, given=None, bad_structure=None):
        """Reads `samples` (`load(j)`: sample j, `leaves_of(sample)`: its leaves, None for a
        sample of another structure, then `bad_structure(j, sample)` is raised) and writes
        each into its row from `start` on as it is read; each is dropped before the next
        is read (the NOTE in `_samples.py`). `given`: the lengths the user gave for them
        (checked against the samples), or None. The loop is the per-sample cost of a
        padded batch: what each leaf needs is in its `cols` entry (see `__init__`)."""
        cols, used, right = self.cols, self.used, self.right
        for i, j in enumerate(samples):
            r = start + i
            sample = load(j)
            leaves = leaves_of(sample)
            if leaves is None:
                raise bad_structure(j, sample)
            for leaf, (k, out, target, dtype, ndim, shape, pad, gives_length, cap, truncate, rows, scalar) in zip(
                    leaves, cols):
                if target is None:  # (a leaf not padded, a label: gathered, written by finish)
                    if type(leaf) is not scalar:  # (a NumPy scalar of the batch's type: dtype and shape are right)
                        leaf = leaf if type(leaf) is _ndarray or isinstance(leaf, _generic) else np.asarray(leaf)
                        if (leaf.dtype is not dtype and leaf.dtype != dtype) or leaf.shape != shape:
                            raise self._mismatch(k, j, leaf)
                    rows[r] = leaf
                    continue
                if type(leaf) is not _ndarray:
                    leaf = np.asarray(leaf)
                got = leaf.shape
                if (leaf.dtype is not dtype and leaf.dtype != dtype) or len(got) != ndim or (
                        ndim > 1 and got[1:] != shape):
                    raise self._mismatch(k, j, leaf)
                n = got[0]
                if gives_length:
                    if given is not None and n != given[i]:
                        raise BatchStructureError(
                            f"Sample {j} of `{self.plan.name}` has {self.plan.paths[k]} of length {n}, but `lengths` "
                            f"gave {given[i]} for it. Give from_samples lengths that match the samples (or "
                            "lengths=None to measure them).")
                if n > cap:
                    if not truncate:
                        raise BatchStructureError(
                            f"Sample {j} of `{self.plan.name}` has {self.plan.paths[k]} of length {n}, longer than the "
                            f"padded length {self.limit}. Give Padding(too_long='truncate') to cut it, or "
                            "too_long='drop' to leave such samples out, or a larger length.")
                    leaf = leaf[:target] if right else leaf[n - target:]
                    n = target
                if gives_length:
                    used[r] = n
                if right:
                    out[r, :n] = leaf
                    if pad is not None:
                        out[r, n:] = pad
                else:
                    out[r, target - n:] = leaf
                    if pad is not None:
                        out[r, :target - n] = pad
            sample = leaves = leaf = None

    def _mismatch(self, k, j, leaf):
        shape, dtype = self.refs[k]
        what = ("its first axis padded" if self.targets[k] is not None
                else "not padded: name it in Padding(leaves=...) to pad it")
        return BatchStructureError(
            f"Sample {j} of `{self.plan.name}` has {self.plan.paths[k]} with shape {leaf.shape} and dtype {leaf.dtype}, "
            f"but sample {self.first} of the same batch had {shape} and {dtype} ({what}). Samples must agree "
            "in dtype, rank and every axis but the padded first one: cast or reshape them in __getitem__.")

    def finish(self):
        """The batch: the sample's structure, with the mask/lengths keys added."""
        for _, out, _, _, _, _, _, _, _, _, rows, _ in self.cols:
            if rows is not None and out.ndim == 1:
                out[...] = rows  # (one conversion for the batch's scalars)
            elif rows is not None:
                for r, value in enumerate(rows):
                    out[r] = value
        tree = _tree.unflatten(self.plan.treedef, self.out)
        p = self.plan.padding
        if p.mask is None and p.lengths is None:
            return tree
        into = tree if isinstance(tree, dict) else tree[0]
        target = self.targets[self.plan.length_leaf]
        if p.mask is not None:  # (one comparison for the batch: 1 where a row's position holds a value)
            mask = self.extra[0]
            used = np.array(self.used, np.int64)[:, None]
            positions = np.arange(target)
            if p.side == "right":
                np.less(positions, used, out=mask, casting="unsafe")
            else:
                np.greater_equal(positions, target - used, out=mask, casting="unsafe")
            into[p.mask] = mask
        if p.lengths is not None:
            lengths = self.extra[-1]
            lengths[:] = self.used
            into[p.lengths] = lengths
        return tree


def _extra_dict(treedef, name):
    """Where the mask/lengths keys go: the sample's dict, or its first element's."""
    if treedef[0] == "dict":
        return treedef
    if treedef[0] in ("tuple", "list") and treedef[1] and treedef[1][0][0] == "dict":
        return treedef[1][0]
    raise BatchStructureError(
        f"`Padding(mask=...)` / `Padding(lengths=...)` add a key to a dict, but samples of `{name}` are "
        f"{_tree.describe(treedef)}. Return a dict sample ({{'ids': ..., 'label': ...}}) or "
        "(inputs_dict, targets), or leave mask/lengths out (Embedding(mask_zero=True) masks by value).")


def _carve(specs):
    """Arrays of these `(shape, dtype)`s in one `kpipe.empty` block (the slot), each at a
    64-byte-aligned offset: one allocation per batch instead of one per array (~14 us each
    in a loaded worker)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = -(-total // 64) * 64
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    block = _alloc.empty((total,), np.uint8)
    return [np.ndarray(shape, dtype, buffer=block, offset=at) for (shape, dtype), at in zip(specs, offsets)]


def _same(value):
    return value


def _scalar_type(shape, dtype):
    """The NumPy scalar type whose every value has this shape and dtype (`np.int32` for
    `()`, int32), or None: a label of that type needs no check."""
    return dtype.type if shape == () and dtype.kind in "biufc" and dtype.isnative else None


def as_leaf(value):
    """A sample's leaf as an array (NumPy scalars and arrays as they are)."""
    return value if type(value) is np.ndarray or isinstance(value, np.generic) else np.asarray(value)
