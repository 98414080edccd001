"""Generated datasets and consumers for the differential suite (tests/test_differential.py).

`spec(seed)` draws one combination of behaviours users write -- how a batch is built
(`np.stack` with and without `out=`, a kept or fresh `kpipe.empty`, a view of a big held
array, a memmap), caches, kept references, permanent exceptions, hooks that change the
dataset, its class or a global (or its length), edits made between passes outside any
hook, NaN and -0.0 bytes -- and a consumer (dropping each batch, holding every batch,
reading a pass in random order). `run_serial` calls the dataset itself; `run_loader` reads
a `ProcessLoader` the same way. Both return, per pass, `{sample id: outcome}` (an
outcome is a batch's leaves as (dtype, shape, bytes), or the exception's type name) plus
the held batches re-read at the end.

Datasets are classes made inside `make_dataset`, so cloudpickle sends them (and the global
`STATE` their methods use) by value, as it does a class defined in `__main__`.
"""

import random

import numpy as np

import kpipe

STATE = {"v": 0}  # a module global a hook may change (travels by value with the class)

BUILDS = ("fresh", "stack", "stack_out", "empty_kept", "empty", "view", "memmap")
HOOKS = (None, "epoch", "class", "global", "perm", "inplace", "length")
EDITS = (None, "attribute", "inplace", "class")
CONSUMERS = ("drop", "hold", "random")


def spec(seed):
    """One generated case: the dataset's behaviours and the consumer's."""
    rng = random.Random(seed)
    return {
        "seed": seed,
        "n": rng.choice([3, 4, 5]),
        "build": rng.choice(BUILDS),
        "big": rng.random() < 0.6,  # a batch of 1 MiB (the np.stack interception's size) or 8 KiB
        "cache": rng.random() < 0.3,
        "keep_last": rng.random() < 0.3,
        "fails": rng.random() < 0.2,  # batch 1 always raises
        "hook": rng.choice(HOOKS),
        "edit": rng.choice(EDITS),
        "shared_table": rng.random() < 0.5,  # the table a value reads is >= 1 MiB: a shared array
        "consumer": rng.choice(CONSUMERS),
        "passes": 3,
    }


def describe(s):
    return " ".join(f"{k}={v}" for k, v in s.items())


def make_dataset(s, memmap_path):
    """A fresh class (and instance) for spec `s`; resets `STATE`."""
    STATE["v"] = 0
    width = 32768 if s["big"] else 256  # x: (8, width) float32 -> 1 MiB or 8 KiB
    hook, build = s["hook"], s["build"]

    class Generated:
        k = 0  # a class attribute a hook or an edit may change

        def __init__(self):
            self.n = s["n"]
            self.epoch = 0
            self.offset = 0.0
            self.table = np.zeros((1 << 18) if s["shared_table"] else 64, np.float32)
            self.table[1], self.table[2] = np.nan, -0.0
            self.perm = np.arange(s["n"])
            self.cache, self.buf, self.last = {}, None, None
            self.big = np.arange(8 * 4 * width, dtype=np.float32).reshape(4, 8, width)  # shared (4 MiB)
            self.mm = np.memmap(memmap_path, dtype=np.float32, mode="r", shape=(8, width)) if build == "memmap" else None

        def __len__(self):
            return self.n

        def value(self, i):
            return (int(self.perm[i % len(self.perm)]) + 1000 * self.epoch + 100 * type(self).k + 10 * STATE["v"]
                    + self.offset + float(self.table[3]))

        def __getitem__(self, i):
            if not 0 <= i < self.n:
                raise IndexError(i)
            if s["fails"] and i == 1:
                raise KeyError(f"batch {i} is missing")
            v = self.value(i)
            key = (i, v)
            if s["cache"] and key in self.cache:
                x = self.cache[key]
            else:
                x = self._build(i, v)
                if s["cache"]:
                    self.cache[key] = x
            if s["keep_last"]:
                self.last = x
            return {"x": x, "id": np.array([i], np.int64), "v": np.float64(v)}

        def _build(self, i, v):
            rows = [np.full(width, v + r, np.float32) for r in range(8)]
            for row in rows[:1]:
                row[1], row[2] = self.table[1], self.table[2]  # NaN and -0.0 bytes
            if build == "stack":
                return np.stack(rows)
            if build == "stack_out":
                if self.buf is None:
                    self.buf = np.stack(rows)
                    return self.buf
                return np.stack(rows, out=self.buf)
            if build in ("empty", "empty_kept"):
                x = self.buf if build == "empty_kept" and self.buf is not None else kpipe.empty((8, width), np.float32)
                if build == "empty_kept":
                    self.buf = x
                x[...] = rows
                return x
            if build == "view":
                return self.big[i % 4] + v  # (a new array from a view of a shared array)
            if build == "memmap":
                return np.asarray(self.mm) + np.stack(rows)
            return np.array(rows)

    if hook is not None:
        def on_epoch_end(self):
            self.epoch += 1 if hook == "epoch" else 0
            if hook == "class":
                type(self).k += 1
            elif hook == "global":
                STATE["v"] += 1
            elif hook == "perm":
                self.epoch += 1
                self.perm = np.random.default_rng(self.epoch).permutation(s["n"])
            elif hook == "inplace":
                self.table[3] += 1.0
            elif hook == "length":
                self.n = s["n"] - 1 if self.n == s["n"] else s["n"]

        Generated.on_epoch_end = on_epoch_end
    return Generated, Generated()


def edit_between(s, ds):
    """The edit a consumer makes between passes, outside any hook."""
    if s["edit"] == "attribute":
        ds.offset += 0.5
    elif s["edit"] == "inplace":
        ds.table[3] += 2.0
    elif s["edit"] == "class":
        type(ds).k += 3


def outcome(batch):
    return tuple((k, a.dtype.str, a.shape, a.tobytes()) for k, a in sorted((k, np.asarray(v)) for k, v in batch.items()))


def _access_order(s, n, p):
    """The consumer's reads in pass `p`. A random order never reads the last batch right
    after the one before it: a loader ends its pass there (`loader[i]` read in order to the
    end), and `on_epoch_end` ends it otherwise."""
    order = list(range(n))
    if s["consumer"] == "random":
        rng = random.Random(s["seed"] * 31 + p)
        rng.shuffle(order)
        while any(a == n - 2 and b == n - 1 for a, b in zip(order, order[1:])):
            rng.shuffle(order)
    return order


def _read(get, i):
    try:
        batch = get(i)
    except Exception as exc:  # the dataset's own exception, as the consumer sees it
        return None, type(exc).__name__
    return batch, outcome(batch)


def run_serial(s, memmap_path):
    """The dataset called directly: `ds[i]` for each batch, then the edit, then its hook."""
    _, ds = make_dataset(s, memmap_path)
    return _consume(s, ds, ds.__getitem__, lambda: len(ds), getattr(ds, "on_epoch_end", lambda: None),
                    key=lambda i, batch: i)


def run_loader(s, memmap_path, **kwargs):
    """The same reads through `ProcessLoader(ds, **kwargs)`; batch ids from the batches
    (a shuffled loader's `loader[i]` is another id)."""
    _, ds = make_dataset(s, memmap_path)
    with kpipe.ProcessLoader(ds, **kwargs) as loader:
        passes, held = _consume(s, ds, loader.__getitem__, lambda: len(loader), loader.on_epoch_end,
                                key=lambda i, batch: int(batch["id"][0]) if batch is not None else ("error", i))
        stats = loader.stats()
    return (passes, held), stats


def _consume(s, ds, get, length, end_pass, key):
    passes, held = [], []
    for p in range(s["passes"]):
        seen = {}
        for i in _access_order(s, length(), p):
            batch, got = _read(get, i)
            seen[key(i, batch)] = got
            if batch is not None and s["consumer"] == "hold":
                held.append((batch, got))
            del batch
        passes.append(seen)
        edit_between(s, ds)
        end_pass()
    # held batches, re-read now: what each held when it was handed out
    return passes, [(outcome(batch) == got) for batch, got in held]


def normalise_errors(passes):
    """A shuffled loader's failing batch has no id of its own: its errors, counted."""
    out = []
    for seen in passes:
        ok = {k: v for k, v in seen.items() if not (isinstance(k, tuple) and k[0] == "error")}
        errors = sorted(v for k, v in seen.items() if isinstance(k, tuple) and k[0] == "error")
        out.append((ok, errors))
    return out


def serial_errors(passes):
    """The serial run's passes in `normalise_errors`' form (a failing id's outcome is a name)."""
    out = []
    for seen in passes:
        ok = {k: v for k, v in seen.items() if not isinstance(v, str)}
        errors = sorted(v for v in seen.values() if isinstance(v, str))
        out.append((ok, errors))
    return out
