"""Flattening batches into (structure, leaves) and checking them against batch 0.

A batch is a tree: tuples, lists and dicts (string keys) nest; leaves are NumPy arrays
(or anything `np.asarray` turns into a numeric or bool array); `None` is allowed as an
empty node, as Keras allows `(x, y, None)`. The structure ("treedef") is a small nested
tuple of plain Python values, so it pickles cheaply and compares with `==`.

As Keras takes them: a dict's keys are a set (they name model inputs and outputs), so a
treedef lists them sorted and a batch comes back with its keys in that order, whatever
order `__getitem__` inserted them in (a dict built from a `set` iterates in another
order in each worker process); an array in non-native byte order (`>f4`) is handed over
in native order (Keras's tensors are native: DLPack refuses the other); dtypes that
change between batches are cast to batch 0's where NumPy casts them within a kind
(`StructureChecker.check`), as Keras casts every batch to the model's input dtype.
"""

import numpy as np

from kpipe._engine._shm import as_dtype, dtype_token, is_ml_dtype

from kpipe.errors import BatchStructureError

# Array kinds that can be handed over as raw bytes: bool, signed, unsigned, float, complex.
_OK_KINDS = frozenset("biufc")
_LEAF = ("leaf",)
_NONE = ("none",)


def flatten(batch, *, what="batch"):
    """Returns `(treedef, leaves, paths)` for a batch; leaves are NumPy arrays.

    Raises:
        BatchStructureError: if a leaf is not numeric/bool, or a container is unsupported.
    """
    leaves, paths = [], []
    treedef = _flatten(batch, what, leaves, paths)
    return treedef, leaves, paths


def _flatten(node, path, leaves, paths):
    if node is None:
        return _NONE
    if isinstance(node, dict):
        for k in node:
            if not isinstance(k, str):
                raise BatchStructureError(
                    f"{path} is a dict with key {k!r} of type {type(k).__name__}; batch dicts "
                    "must have string keys (they name model inputs/outputs)."
                )
        keys = sorted(node)  # (a set of names: see the module docstring)
        return ("dict", tuple(keys), tuple(_flatten(node[k], f"{path}[{k!r}]", leaves, paths) for k in keys))
    if isinstance(node, (tuple, list)):
        kind = "tuple" if isinstance(node, tuple) else "list"
        return (kind, tuple(_flatten(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(node)))
    arr = node if isinstance(node, np.ndarray) else _as_array(node, path)
    if not arr.dtype.isnative:  # big-endian on a little-endian host, or the reverse
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype.kind not in _OK_KINDS and not is_ml_dtype(arr.dtype):  # (bfloat16 & co.: raw bytes too)
        raise BatchStructureError(
            f"{path} has dtype {arr.dtype} (received {_short(node)}). kpipe hands batches over "
            "as raw numeric memory: return numeric or bool NumPy arrays, e.g. encode strings "
            "as integer ids or convert with np.asarray(value, dtype=np.float32)."
        )
    leaves.append(arr)
    paths.append(path)
    return _LEAF


_COMPOSITE = {  # tensors NumPy cannot hold as one array: what they are, what to do
    "SparseTensor": "a tf.SparseTensor (indices, values, dense_shape)",
    "RaggedTensor": "a tf.RaggedTensor (rows of different lengths)",
}


def _as_array(node, path):
    kind = _COMPOSITE.get(type(node).__name__)
    if kind is not None and type(node).__module__.startswith("tensorflow"):
        raise BatchStructureError(
            f"{path} is {kind}. kpipe hands batches over as dense arrays in shared memory and "
            "carries no sparse or ragged tensors: return it dense (tf.sparse.to_dense(x) / "
            "x.to_tensor(), then .numpy()), padded to a length with a mask or sequence lengths "
            "beside it, or its component arrays as separate leaves that the model reassembles; "
            "or load it with workers=0 (plain Keras's path)."
        )
    if hasattr(node, "numpy") and callable(node.numpy):  # a tf.Tensor / EagerTensor
        node = node.numpy()
    try:
        return np.asarray(node)
    except Exception as exc:  # ragged lists and the like
        raise BatchStructureError(
            f"{path} is a {type(node).__name__} that NumPy cannot turn into an array "
            f"(received {_short(node)}): {exc}. Return NumPy arrays."
        ) from None


def unflatten(treedef, leaves):
    """Inverse of `flatten`: rebuilds the batch from its treedef and leaves."""
    it = iter(leaves)
    out = _unflatten(treedef, it)
    return out


def _unflatten(td, it):
    tag = td[0]
    if tag == "leaf":
        return next(it)
    if tag == "none":
        return None
    if tag == "dict":
        return {k: _unflatten(c, it) for k, c in zip(td[1], td[2])}
    children = [_unflatten(c, it) for c in td[1]]
    return tuple(children) if tag == "tuple" else children


def without_rows(batch):
    """`batch` with no rows: every array of rank >= 1 emptied along its first axis (same
    dtype and inner shape); the structure and rank-0 arrays as they are."""
    treedef, leaves, _ = flatten(batch)
    empty = [np.empty((0,) + a.shape[1:], a.dtype) if a.ndim else a for a in leaves]
    return unflatten(treedef, empty)


def leaf_paths(treedef, what="batch"):
    """The path of each leaf of `treedef`, e.g. `batch[0]`, `batch[1]['label']`."""
    paths = []

    def walk(td, path):
        if td[0] == "leaf":
            paths.append(path)
        elif td[0] == "dict":
            for k, c in zip(td[1], td[2]):
                walk(c, f"{path}[{k!r}]")
        elif td[0] in ("tuple", "list"):
            for i, c in enumerate(td[1]):
                walk(c, f"{path}[{i}]")

    walk(treedef, what)
    return paths


def describe(treedef):
    """A short human description of a structure, e.g. `(array, array)`."""
    tag = treedef[0]
    if tag == "leaf":
        return "array"
    if tag == "none":
        return "None"
    if tag == "dict":
        return "{" + ", ".join(f"{k!r}: {describe(c)}" for k, c in zip(treedef[1], treedef[2])) + "}"
    inner = ", ".join(describe(c) for c in treedef[1])
    return f"({inner}{',' if len(treedef[1]) == 1 else ''})" if tag == "tuple" else f"[{inner}]"


def _short(value, limit=100):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class StructureChecker:
    """Checks every batch against batch 0: same structure, dtypes and ranks.

    Shapes may differ (a ragged last batch, variable image sizes); structure, dtype and
    rank may not, because Keras builds one tensor spec for all batches.
    """

    def __init__(self, dataset_name):
        self._name = dataset_name
        self._ref = None  # (position, treedef, [(dtype_str, shape)])

    def check(self, position, treedef, meta, batch=None):
        """`meta` is a list of `(dtype_str, shape)` per leaf. Returns `batch` (the batch of
        `treedef`), its leaves whose dtype differs from batch 0's cast to batch 0's dtype
        where NumPy casts within a kind (`same_kind`: float64 to float32, int32 to int64),
        as Keras casts every batch to the model's input dtype; `meta` is updated to match.

        Raises:
            BatchStructureError: naming the batch, the leaf and both values.
        """
        if self._ref is None:
            self._ref = (position, treedef, list(meta))
            return batch
        ref_pos, ref_td, ref_meta = self._ref
        if treedef != ref_td:
            raise BatchStructureError(
                f"Batch {position} of `{self._name}` has structure {describe(treedef)} but batch "
                f"{ref_pos} had {describe(ref_td)}. Every batch must have the same structure; "
                "return the same tuple/dict layout from every __getitem__ call."
            )
        paths = leaf_paths(treedef)
        casts = {}
        for k, (path, (dt, shape), (rdt, rshape)) in enumerate(zip(paths, meta, ref_meta)):
            if dt != rdt:
                if batch is None or not np.can_cast(as_dtype(dt), as_dtype(rdt), casting="same_kind"):
                    raise BatchStructureError(
                        f"Batch {position} of `{self._name}` has {path} with dtype "
                        f"{as_dtype(dt)} but batch {ref_pos} had {as_dtype(rdt)}, which NumPy does not "
                        f"cast it to within a kind. Cast it to {as_dtype(rdt)} in __getitem__ so all "
                        "batches share one dtype."
                    )
                casts[k] = as_dtype(rdt)
            if len(shape) != len(rshape):
                raise BatchStructureError(
                    f"Batch {position} of `{self._name}` has {path} with shape {tuple(shape)} "
                    f"but batch {ref_pos} had {tuple(rshape)}: the number of dimensions must "
                    "not change between batches (sizes may)."
                )
        if not casts:
            return batch
        _, leaves, _ = flatten(batch)
        for k, dtype in casts.items():
            leaves[k] = leaves[k].astype(dtype, casting="same_kind")
            meta[k] = (dtype_token(dtype), meta[k][1])
        return unflatten(treedef, leaves)
