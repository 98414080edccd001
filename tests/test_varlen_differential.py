"""Differential suite for variable-length batches: padded and bucketed `from_samples`
batches read through process workers, which the consumer holds (as a user appending
batches to a list does) while later batches arrive in reused slots, against the same
batches made by calling the dataset serially in this process.

Each case is generated (`tests/_varlen_differential.py`: lengths with empty and long
samples, tuple or dict samples, dtypes, every `Padding` option, each kind of `Buckets`,
lengths given or measured, the shuffle, the queue depth, how batches are held) and read
for two passes with 1 and with 2 workers. Batches are compared by bytes as they arrive;
everything the consumer still holds is compared again after each later batch and at the
end: slot reuse must never write into a batch (or a leaf, or a view of one) still held.
A failure names the seed: `spec(seed)` rebuilds the case.
"""

import warnings

import pytest

import kpipe
from kpipe import _samples
from _varlen_differential import dataset, describe, fingerprint, held_part, leaves, options, spec

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

DEFAULT_CASES = 10
LONG_CASES = 30


def _serial(s):
    """The serial reference: the loader's own `SampleBatches`, called in this process."""
    opts = options(s, kpipe.Padding, kpipe.Buckets)
    shuffle, seed, drop = opts.pop("shuffle"), opts.pop("seed"), opts.pop("drop_remainder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = _samples.for_loader(dataset(s), s["batch_size"], shuffle=shuffle, seed=seed, drop_remainder=drop,
                                      has_hooks=False, options=opts)
    key_seed = seed if shuffle else None
    return [[fingerprint(leaves(batches[(p, b, key_seed)])) for b in range(len(batches))] for p in range(s["passes"])]


def _read_held(s, workers):
    """Reads `s["passes"]` passes through a loader, holding batches as `s["hold"]` says;
    checks every held part against its bytes at arrival after each later batch. Returns
    the fingerprints per pass and the number of held parts checked."""
    opts = options(s, kpipe.Padding, kpipe.Buckets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = kpipe.ProcessLoader.from_samples(dataset(s), s["batch_size"], workers=workers,
                                                  max_queue_size=s["max_queue_size"], **opts)
    got, held, checks = [], [], 0
    with loader:
        for p in range(s["passes"]):
            got.append([])
            for b in range(len(loader)):
                batch = loader[b]
                got[-1].append(fingerprint(leaves(batch)))
                part = held_part(batch, s["hold"], b)
                if part is not None:
                    held.append((p, b, part, fingerprint(leaves(part))))
                if s["hold"] == "window" and len(held) > 3:
                    held.pop(0)
                batch = part = None
                for hp, hb, kept, then in held:
                    assert fingerprint(leaves(kept)) == then, (
                        f"held batch {hb} of pass {hp} changed after batch {b} of pass {p} arrived "
                        f"(workers={workers}): {describe(s)}")
                    checks += 1
    for hp, hb, kept, then in held:  # (and after the loader is closed)
        assert fingerprint(leaves(kept)) == then, f"held batch {hb} of pass {hp} changed at close: {describe(s)}"
    return got, checks


def _check(seed):
    s = spec(seed)
    try:
        want = _serial(s)
    except ValueError as e:  # (every sample dropped, say): the loader refuses it alike
        with pytest.raises(type(e), match="samples"):
            _read_held(s, 1)
        return
    for workers in (1, 2):
        got, checks = _read_held(s, workers)
        assert len(got) == len(want)
        for p, (g, w) in enumerate(zip(got, want)):
            assert len(g) == len(w), f"pass {p} has {len(g)} batches, serially {len(w)}: {describe(s)}"
            for b, (gb, wb) in enumerate(zip(g, w)):
                assert gb == wb, f"batch {b} of pass {p} differs (workers={workers}): {describe(s)}"
        assert checks > 0 or s["hold"] == "every_third"


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_held_padded_batches_equal_the_serial_ones_and_never_change(seed, no_leaks):
    _check(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DEFAULT_CASES, DEFAULT_CASES + LONG_CASES))
def test_more_generated_cases(seed, no_leaks):
    _check(seed)


def test_the_generated_cases_cover_every_behaviour():
    cases = [spec(seed) for seed in range(DEFAULT_CASES)]
    for key in ("hold", "bucket", "side", "dict_samples", "give_lengths", "shuffle"):
        drawn = {str(c[key]) for c in cases}
        assert len(drawn) >= 2, (key, drawn)
    everything = [spec(seed) for seed in range(DEFAULT_CASES + LONG_CASES)]
    for key, values in (("hold", ("all", "window", "every_third", "leaf", "view")),
                        ("bucket", ("None", "bounds", "bounds_fixed", "sorted")),
                        ("too_long", ("raise", "truncate", "drop"))):
        assert {str(c[key]) for c in everything} >= set(values), key
