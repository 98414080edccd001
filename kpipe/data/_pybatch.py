"""The part of `py_map_fn` that runs in worker processes: apply a per-sample function to a batch.

Imports only NumPy: kpipe worker processes never import TensorFlow on kpipe's account.
"""

import numpy as np


class BatchApply:
    """Applies `fn` to each sample of a batch and stacks the results.

    A batch is a tree (tuple/list/dict nesting) of arrays whose first dimension indexes
    samples. Sample `i` is the same tree of the arrays' rows `i`; `fn` is called with it
    unpacked when it is a tuple (`fn(x, y)`, as `tf.data.Dataset.map` does) or as is.
    Outputs are stacked into arrays whose dtypes are `dtypes` (flat, in `flatten` order)
    when given; lists in outputs become tuples.

    Args:
        fn: The user's per-sample function.
        dtypes: Output dtypes to cast to (flat), or None to keep what `fn` returns.
    """

    def __init__(self, fn, dtypes=None):
        self.fn = fn
        # What the engine's messages call this function ("... while loading item 3 with `aug`").
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
        self.dtypes = None if dtypes is None else [np.dtype(d) for d in dtypes]

    def __call__(self, batch):
        n = _batch_len(batch)
        out_structure, buffers = None, None
        for i in range(n):
            sample = map_tree(lambda a: a[i], batch)
            result = self.fn(*sample) if isinstance(sample, tuple) else self.fn(sample)
            structure, leaves = flatten(result)
            if buffers is None:
                out_structure = structure
                buffers = [
                    np.empty((n,) + leaf.shape, self.dtypes[j] if self.dtypes else leaf.dtype)
                    for j, leaf in enumerate(leaves)
                ]
                if self.dtypes is not None and len(self.dtypes) != len(leaves):
                    raise ValueError(
                        f"py_map_fn returned {len(leaves)} arrays for a sample, but {len(self.dtypes)} "
                        "for the first sample (or the declared output signature). Return the same "
                        "structure for every sample."
                    )
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
                buf[i] = leaf
        if buffers is None:
            raise ValueError("py_map_fn received an empty batch.")
        return unflatten(out_structure, buffers)


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
