"""Differential suite: every fast path against the dataset called directly.

Each case is a generated dataset and consumer (`tests/_differential.py`: how batches are
built, caches, kept buffers, exceptions, hooks, edits between passes, NaN/-0.0 bytes,
held batches, random access); the serial run calls the dataset itself, and the loader
runs read it through `ProcessLoader` with one worker, with two workers and a shuffled
order, and with `epoch_end_ahead=True`. Batches are compared by bytes, per pass and per
batch id; batches a consumer holds are re-read at the end and must not have changed.
`DEFAULT_CASES` seeds run in every suite; `slow` adds `LONG_CASES` more. A failure names
the seed: `spec(seed)` rebuilds the case.
"""

import numpy as np
import pytest

import kpipe
from _differential import describe, make_dataset, normalise_errors, run_loader, run_serial, serial_errors, spec

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

DEFAULT_CASES = 8
LONG_CASES = 24


def _memmap_file(tmp_path):
    path = tmp_path / "rows.f32"
    np.arange(8 * 32768, dtype=np.float32).tofile(path)
    return str(path)


def _configs(s):
    """The loader settings a case runs under. Two workers hold two copies of a dataset
    whose `__getitem__` changes it: where it keeps one buffer it refills (and caches it),
    each copy's aliasing differs from the one serial object's, as any multi-process
    loader's would: those run with one worker only."""
    configs = [dict(workers=1)]
    per_process = s["cache"] and s["build"] in ("stack_out", "empty_kept")
    if not per_process:
        configs.append(dict(workers=2, shuffle=True, seed=s["seed"]))
        configs.append(dict(workers=2, epoch_end_ahead=True))
    return configs


def _check(seed, tmp_path):
    s = spec(seed)
    path = _memmap_file(tmp_path)
    serial_passes, _ = run_serial(s, path)
    want = serial_errors(serial_passes)
    assert sum(len(ok) for ok, _ in want) > 0  # (every case hands out batches)
    for kwargs in _configs(s):
        (passes, held), stats = run_loader(s, path, **kwargs)
        got = normalise_errors(passes)
        for p, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"pass {p} differs under {kwargs} for seed {seed}: {describe(s)}"
        assert len(got) == len(want)
        assert all(held), f"a held batch changed under {kwargs} for seed {seed}: {describe(s)}"


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_the_loader_gives_what_the_dataset_gives(seed, tmp_path, no_leaks):
    _check(seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DEFAULT_CASES, DEFAULT_CASES + LONG_CASES))
def test_the_loader_gives_what_the_dataset_gives_longer_run(seed, tmp_path, no_leaks):
    _check(seed, tmp_path)


def test_the_generator_covers_every_behaviour():
    """The seeds the suites run draw every build, hook, edit and consumer (so a fast path
    no case reaches cannot hide)."""
    from _differential import BUILDS, CONSUMERS, EDITS, HOOKS

    specs = [spec(seed) for seed in range(DEFAULT_CASES + LONG_CASES)]
    for field, values in (("build", BUILDS), ("hook", HOOKS), ("edit", EDITS), ("consumer", CONSUMERS)):
        assert {s[field] for s in specs} == set(values), field
    for flag in ("big", "cache", "keep_last", "fails", "shared_table"):
        assert {s[flag] for s in specs} == {True, False}, flag


@pytest.mark.parametrize("seed", [3, 5, 11])
def test_from_samples_gives_the_samples_the_dataset_gives(seed, tmp_path, no_leaks):
    """The per-sample form over the same behaviours: batch b holds samples b*bs.. in order
    (shuffle off), as `np.stack` of the dataset's samples would."""
    s = dict(spec(seed), fails=False, n=4, build="stack")
    path = _memmap_file(tmp_path)
    batch_size = 2

    def sample_dataset():
        cls, ds = make_dataset(s, path)

        class Samples:
            def __init__(self):
                self.ds = ds

            def __len__(self):
                return len(self.ds) * batch_size

            def __getitem__(self, j):
                x = self.ds[j // batch_size]["x"][j % batch_size]
                return x.copy(), np.int64(j)

        if hasattr(cls, "on_epoch_end"):
            Samples.on_epoch_end = lambda self: self.ds.on_epoch_end()
        return Samples()

    def read(get, length, end_pass, data):
        out = []
        for _ in range(3):
            out.append([tuple(np.asarray(a).tobytes() for a in get(b)) for b in range(length())])
            from _differential import edit_between

            edit_between(s, data.ds)
            end_pass()
        return out

    data = sample_dataset()

    def serial_batch(b):
        samples = [data[j] for j in range(b * batch_size, (b + 1) * batch_size)]
        return np.stack([x for x, _ in samples]), np.array([j for _, j in samples])

    want = read(serial_batch, lambda: len(data) // batch_size, getattr(data, "on_epoch_end", lambda: None), data)
    data = sample_dataset()
    with kpipe.ProcessLoader.from_samples(data, batch_size, workers=2) as loader:
        got = read(loader.__getitem__, lambda: len(loader), loader.on_epoch_end, data)
    assert got == want, describe(s)
