"""Flattening batches into (structure, leaves) and checking them against batch 0.

A batch is a tree: tuples, lists and dicts (string keys) nest; leaves are NumPy arrays
(or anything `np.asarray` turns into a numeric or bool array); `None` is allowed as an
empty node, as Keras allows `(x, y, None)`. The structure ("treedef") is a small nested
tuple of plain Python values, so it pickles cheaply and compares with `==`.
"""

import numpy as np

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
        keys = list(node)
        for k in keys:
            if not isinstance(k, str):
                raise BatchStructureError(
                    f"{path} is a dict with key {k!r} of type {type(k).__name__}; batch dicts "
                    "must have string keys (they name model inputs/outputs)."
                )
        return ("dict", tuple(keys), tuple(_flatten(node[k], f"{path}[{k!r}]", leaves, paths) for k in keys))
    if isinstance(node, (tuple, list)):
        kind = "tuple" if isinstance(node, tuple) else "list"
        return (kind, tuple(_flatten(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(node)))
    arr = node if isinstance(node, np.ndarray) else _as_array(node, path)
    if arr.dtype.kind not in _OK_KINDS:
        raise BatchStructureError(
            f"{path} has dtype {arr.dtype} (received {_short(node)}). kpipe hands batches over "
            "as raw numeric memory: return numeric or bool NumPy arrays, e.g. encode strings "
            "as integer ids or convert with np.asarray(value, dtype=np.float32)."
        )
    leaves.append(arr)
    paths.append(path)
    return _LEAF


def _as_array(node, path):
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

    def check(self, position, treedef, meta):
        """`meta` is a list of `(dtype_str, shape)` per leaf.

        Raises:
            BatchStructureError: naming the batch, the leaf and both values.
        """
        if self._ref is None:
            self._ref = (position, treedef, list(meta))
            return
        ref_pos, ref_td, ref_meta = self._ref
        if treedef != ref_td:
            raise BatchStructureError(
                f"Batch {position} of `{self._name}` has structure {describe(treedef)} but batch "
                f"{ref_pos} had {describe(ref_td)}. Every batch must have the same structure; "
                "return the same tuple/dict layout from every __getitem__ call."
            )
        paths = leaf_paths(treedef)
        for path, (dt, shape), (rdt, rshape) in zip(paths, meta, ref_meta):
            if dt != rdt:
                raise BatchStructureError(
                    f"Batch {position} of `{self._name}` has {path} with dtype "
                    f"{np.dtype(dt)} but batch {ref_pos} had {np.dtype(rdt)}. Cast it to "
                    f"{np.dtype(rdt)} in __getitem__ so all batches share one dtype."
                )
            if len(shape) != len(rshape):
                raise BatchStructureError(
                    f"Batch {position} of `{self._name}` has {path} with shape {tuple(shape)} "
                    f"but batch {ref_pos} had {tuple(rshape)}: the number of dimensions must "
                    "not change between batches (sizes may)."
                )
