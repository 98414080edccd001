"""The part of `py_map_fn` that runs in worker processes: apply a per-sample function to a batch.

Imports only NumPy: kpipe worker processes never import TensorFlow on kpipe's account.
"""

import random

import numpy as np

from kpipe._engine.worker_info import batch_seed


class BatchApply:
    """Applies `fn` to each sample of a batch and stacks the results.

    Called with `(batch, where)`: a batch is a tree (tuple/list/dict nesting) of arrays
    whose first dimension indexes samples, and `where` is `[iteration, first]`, the
    dataset iteration (0 first) and the index in it of the batch's first element. Sample
    `i` is the same tree of the arrays' rows `i`; `fn` is called with it unpacked when it
    is a tuple (`fn(x, y)`, as `tf.data.Dataset.map` does) or as is. With a `seed`,
    `random` and `numpy.random` are reseeded before each sample from `(seed, iteration,
    first + i)`: a sample's draws depend on where it stands in the dataset, not on the
    process, batch or timing that computes it. Outputs are stacked into arrays of
    `dtypes` (flat, in `flatten` order): with `cast`, each output is converted to them
    (a declared signature); without, a sample whose output has another dtype is an
    error, as in tf.data. Lists in outputs become tuples.

    Args:
        fn: The user's per-sample function.
        dtypes: Output dtypes (flat), or None to take the batch's first sample's.
        cast: Convert outputs to `dtypes` instead of requiring them. Defaults to False.
        seed: Seed of every sample's `random`/`numpy.random`, or None to leave them be.
            Defaults to None.
    """

    def __init__(self, fn, dtypes=None, *, cast=False, seed=None):
        self.fn = fn
        # What the engine's messages call this function ("... while loading item 3 with `aug`").
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
        self.dtypes = None if dtypes is None else [np.dtype(d) for d in dtypes]
        self.cast = cast
        self.seed = seed

    def __call__(self, item):
        batch, where = item
        iteration, first = (int(v) for v in np.asarray(where).reshape(2))
        n = _batch_len(batch)
        out_structure, buffers = None, None
        for i in range(n):
            sample = map_tree(lambda a: a[i], batch)
            if self.seed is not None:
                _reseed(batch_seed(self.seed, iteration, first + i))
            result = self.fn(*sample) if isinstance(sample, tuple) else self.fn(sample)
            structure, leaves = flatten(result)
            if buffers is None:
                out_structure = structure
                if self.dtypes is not None and len(self.dtypes) != len(leaves):
                    raise ValueError(
                        f"py_map_fn returned {len(leaves)} arrays for element {first + i}, but "
                        f"{len(self.dtypes)} for the first element (or the declared output signature). "
                        "Return the same structure for every sample."
                    )
                dtypes = self.dtypes or [leaf.dtype for leaf in leaves]
                buffers = [np.empty((n,) + leaf.shape, dtype) for leaf, dtype in zip(leaves, dtypes)]
            elif structure != out_structure:
                raise ValueError(
                    f"py_map_fn returned a {_describe(structure)} for sample {i} of a batch but a "
                    f"{_describe(out_structure)} for sample 0. Return the same structure for every sample."
                )
            for j, (buf, leaf) in enumerate(zip(buffers, leaves)):
                if leaf.shape != buf.shape[1:]:
                    raise ValueError(
                        f"py_map_fn output {j} has shape {leaf.shape} for sample {i} of a batch but "
                        f"{buf.shape[1:]} for the first sample. Samples are batched, so each output "
                        "must have the same shape for every sample (e.g. crop or resize to a fixed size)."
                    )
                if leaf.dtype != buf.dtype and not self.cast:
                    raise TypeError(
                        f"py_map_fn output {j} has dtype {leaf.dtype} for element {first + i} (sample {i} "
                        f"of a batch, iteration {iteration}) but {buf.dtype} for the first element, "
                        "which set the dataset's output signature. Like tf.data, kpipe does not convert "
                        "between dtypes: return the same dtype for every sample (e.g. "
                        f"np.asarray(value, np.{buf.dtype})), or declare it with `py_output_signature` "
                        "(outputs are then cast to it)."
                    )
                buf[i] = leaf
        if buffers is None:
            raise ValueError("py_map_fn received an empty batch.")
        return unflatten(out_structure, buffers)


def _reseed(seed):
    random.seed(seed)
    np.random.seed(seed)


def _batch_len(batch):
    _, leaves = flatten(batch)
    if not leaves or leaves[0].ndim == 0:
        raise ValueError("py_map_fn received a batch without a sample dimension.")
    return len(leaves[0])


def map_tree(fn, tree):
    if isinstance(tree, dict):
        return {k: map_tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return tuple(map_tree(fn, v) for v in tree)
    return fn(tree)


def flatten(tree):
    """Returns `(structure, leaves)`; dict keys sorted (as `tf.nest`), lists as tuples."""
    leaves = []

    def walk(node):
        if isinstance(node, dict):
            keys = sorted(node)
            return ("dict", tuple(keys), tuple(walk(node[k]) for k in keys))
        if isinstance(node, (tuple, list)):
            return ("tuple", tuple(walk(v) for v in node))
        leaves.append(np.asarray(node))
        return "leaf"

    return walk(tree), leaves


def unflatten(structure, leaves):
    it = iter(leaves)

    def build(s):
        if s == "leaf":
            return next(it)
        if s[0] == "dict":
            return {k: build(v) for k, v in zip(s[1], s[2])}
        return tuple(build(v) for v in s[1])

    return build(structure)


def _describe(structure):
    if structure == "leaf":
        return "single array"
    if structure[0] == "dict":
        return f"dict with keys {list(structure[1])}"
    return f"tuple of {len(structure[1])}"
