"""Generated variable-length cases for tests/test_varlen_differential.py: padded and
bucketed `from_samples` batches that a consumer holds, against the same batches made by
calling the dataset serially. Imports only NumPy (its dataset travels to the workers).

`spec(seed)` draws one case: the samples' lengths (empty ones, a few long ones so the
slot grows and shrinks between batches), a tuple or dict sample with one or two padded
leaves, the dtype, the padding (longest, fixed with truncation or drop, `multiple_of`,
side, pad value, mask and lengths keys), the buckets (none, boundaries with sizes per
bucket, `pad_to_boundary`, sorted windows), lengths given or measured, the shuffle, the
queue depth and how the consumer holds batches (every one, the last few, every third,
one leaf, a view of a leaf).
"""

import random

import numpy as np

HOLDS = ("all", "window", "every_third", "leaf", "view")


class Seqs:
    """Sample j: a sequence of `lengths[j]` rows whose bytes depend on j and the position
    (NaN and -0.0 among float values); a label j. As a dict `{"ids", "feats", "label",
    "pos"}` (`feats`: the same length, 2 columns, float32; `pos`: a (2, 3) float32 leaf,
    padded only where `Padding(leaves=...)` does not leave it out) or a tuple `(ids, label)`."""

    def __init__(self, lengths, dtype, dict_samples, inner):
        self.lengths, self.dtype, self.dict_samples, self.inner = np.asarray(lengths), dtype, dict_samples, inner

    def __len__(self):
        return len(self.lengths)

    def _values(self, j, shape, dtype):
        n = int(np.prod(shape, dtype=np.int64))
        values = ((np.arange(n, dtype=np.int64) * 7 + j * 13) % 251 - 100).astype(dtype).reshape(shape)
        if np.dtype(dtype).kind == "f" and n > 3:
            values.flat[1], values.flat[2] = np.nan, -0.0
        return values

    def __getitem__(self, j):
        if not 0 <= j < len(self):
            raise IndexError(j)
        n = int(self.lengths[j])
        ids = self._values(j, (n,) + self.inner, self.dtype)
        if not self.dict_samples:
            return ids, np.int64(j)
        return {"ids": ids, "feats": self._values(j + 1, (n, 2), np.float32), "label": np.int64(j),
                "pos": self._values(j + 2, (2, 3), np.float32)}


def spec(seed):
    """One generated case (a dict of plain values, printed when it fails)."""
    rng = random.Random(seed)
    n = rng.randint(9, 26)
    lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 34]) if rng.random() < 0.8 else rng.randint(200, 3000)
               for _ in range(n)]
    dict_samples = rng.random() < 0.5
    length = rng.choice(["longest", "longest", 16, 40])
    bucket = rng.choice([None, "bounds", "bounds_fixed", "sorted"])
    too_long = rng.choice(["truncate", "drop"]) if length != "longest" or bucket == "bounds_fixed" else "raise"
    return {
        "seed": seed,
        "lengths": lengths,
        "dtype": rng.choice(["int32", "float32", "int64", "uint8"]),
        "dict_samples": dict_samples,
        "inner": rng.choice([(), (), (3,)]) if not dict_samples else (),
        "batch_size": rng.randint(2, 5),
        "length": length,
        "multiple_of": rng.choice([None, None, 4, 7]),
        "side": rng.choice(["right", "left"]),
        "value": rng.choice([0, -1, 9]),
        "mask": dict_samples and rng.random() < 0.6,
        "name_leaves": dict_samples and rng.random() < 0.5,
        "lengths_key": dict_samples and rng.random() < 0.5,
        "too_long": too_long,
        "bucket": bucket,
        "boundaries": sorted(rng.sample([2, 4, 6, 10, 30, 300], rng.randint(1, 3))),
        "sort_within": rng.randint(1, 3),
        "give_lengths": rng.random() < 0.5 or too_long == "drop",
        "shuffle": rng.random() < 0.7,
        "drop_remainder": rng.random() < 0.2,
        "max_queue_size": rng.choice([1, 2, 3, None]),
        "hold": rng.choice(HOLDS),
        "passes": 2,
    }


def describe(s):
    return " ".join(f"{k}={v}" for k, v in s.items())


def options(s, padding_cls, buckets_cls):
    """The `from_samples` keyword arguments of case `s` (kpipe's classes passed in)."""
    value = s["value"] if s["dtype"] != "uint8" or s["value"] >= 0 else 0
    padding = padding_cls(s["length"], multiple_of=s["multiple_of"], side=s["side"], value=value,
                          mask="mask" if s["mask"] else None, lengths="n" if s["lengths_key"] else None,
                          too_long=s["too_long"], leaves=["ids", "feats"] if s["name_leaves"] else None)
    sizes = [s["batch_size"] + k % 2 for k in range(len(s["boundaries"]) + 1)]
    buckets = {None: None,
               "bounds": buckets_cls(s["boundaries"], sizes),
               "bounds_fixed": buckets_cls(s["boundaries"], sizes, pad_to_boundary=True),
               "sorted": buckets_cls(sort_within=s["sort_within"])}[s["bucket"]]
    out = dict(padding=padding, buckets=buckets, shuffle=s["shuffle"], seed=s["seed"],
               drop_remainder=s["drop_remainder"])
    if s["give_lengths"]:
        out["lengths"] = np.asarray(s["lengths"])
    return out


def dataset(s):
    return Seqs(s["lengths"], np.dtype(s["dtype"]), s["dict_samples"], tuple(s["inner"]))


def leaves(batch):
    """The batch's arrays in a fixed order (dict keys sorted)."""
    if isinstance(batch, dict):
        return [a for k in sorted(batch) for a in leaves(batch[k])]
    if isinstance(batch, (tuple, list)):
        return [a for item in batch for a in leaves(item)]
    return [batch]


def fingerprint(arrays):
    """(dtype, shape, bytes) of each array: equal only where the bytes are."""
    return [(a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()) for a in arrays]


def held_part(batch, hold, i):
    """What the consumer keeps of batch `i` (None: nothing): the batch, one leaf of it, or a
    view of its first leaf."""
    arrays = leaves(batch)
    if hold == "all" or hold == "window" or (hold == "every_third" and i % 3 == 0):
        return batch
    if hold == "leaf":
        return arrays[i % len(arrays)]
    if hold == "view":
        first = arrays[0]
        return first[1:, ::2] if first.ndim >= 2 else first[1:]
    return None
