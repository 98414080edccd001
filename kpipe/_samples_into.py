"""Samples a dataset writes straight into the batch's rows (`kpipe_sample_into`).

NOTE [ Samples written into the slot ]
--------------------------------------
`ProcessLoader.from_samples` builds a batch in its shared-memory slot (the NOTE in
`kpipe/_samples.py`): `__getitem__(j)` returns sample j as arrays of its own, and each is
copied into its row. A decoder that can write its output into a given array (OpenCV's
`resize(..., dst=...)`, `flip(..., dst=...)`) need not make that array at all: a dataset
may define

    kpipe_sample_into(j, out)    writes sample j into `out`: a tree of the sample's
                                 structure whose leaves are the batch's rows (writable views
                                 of the slot, of one sample's shapes and dtypes)

and `from_samples` then calls it for every sample of a batch but the first, whose
`__getitem__` result fixes the batch's structure, shapes and dtypes. No per-sample array
is made, faulted in and copied: on the jpeg workload's 224 px crops with OpenCV this is
the resize's output, the flip's and the colour swap's, ~0.07 ms of ~0.45 ms per image
(`kpipe.data.PackedImages`, which defines it). The method must write every element of
`out` (the slot holds an earlier batch's values), and raise for a sample that does not fit.
"""

from kpipe._engine import _tree


def hook(dataset):
    """The dataset's `kpipe_sample_into`, or None."""
    into = getattr(dataset, "kpipe_sample_into", None)
    return into if callable(into) else None


def fill(into, treedef, batch, samples):
    """Has `into` write samples `samples[1:]` into rows 1.. of the batch's arrays `batch`
    (the leaves of structure `treedef`; row 0 is written already)."""
    for row in range(1, len(samples)):
        into(samples[row], _tree.unflatten(treedef, [out[row, ...] for out in batch]))
