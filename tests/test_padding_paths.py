"""The two write paths of a padded batch (kpipe/_padding.py's `Batch`): a padded batch array
of at most `_PREFILL_BYTES` is filled with the pad value first and each row then gets only
its values; a larger one gets its values and then its pad row by row. Both give the batch a
hand-written loop gives (right and left, truncated, with mask and lengths), and the labels'
fast check (a NumPy scalar of the batch's type) still names a label of another type."""

import numpy as np
import pytest

import kpipe
from kpipe import _padding, _samples
from kpipe.errors import BatchStructureError


class Rows:
    """Sample j: int32 ids of length `lengths[j]` (`width` columns when given) and a label
    from `labels(j)` (an np.int32 by default)."""

    def __init__(self, lengths, width=None, labels=None):
        self.lengths, self.width = list(lengths), width
        self.labels = labels or (lambda j: np.int32(j % 3))

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, j):
        ids = (np.arange(self.lengths[j]) + 10 * j + 1).astype(np.int32)
        if self.width:
            ids = np.repeat(ids[:, None], self.width, axis=1)
        return {"ids": ids, "label": self.labels(j)}


def _reference(ds, samples, padding):
    """The batch a hand-written loop makes: np.full with the pad, each row copied."""
    rows = [ds[j] for j in samples]
    longest = max(len(r["ids"]) for r in rows)
    length = padding.target(longest, None)
    inner = rows[0]["ids"].shape[1:]
    ids = np.full((len(rows), length) + inner, padding.value, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    used = []
    for r, row in enumerate(rows):
        x = row["ids"]
        x = x[:length] if padding.side == "right" else x[max(0, len(x) - length):]
        n = len(x)
        if padding.side == "right":
            ids[r, :n], mask[r, :n] = x, 1
        else:
            ids[r, length - n:], mask[r, length - n:] = x, 1
        used.append(n)
    return {"ids": ids, "label": np.array([row["label"] for row in rows]), "mask": mask,
            "n": np.array(used, np.int32)}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("length", ["longest", 300])
@pytest.mark.parametrize("width", [None, 3])
@pytest.mark.parametrize("big", [False, True])
def test_prefilled_and_row_by_row_batches_equal_a_hand_loop(side, length, width, big):
    # 8 rows of up to 400 int32 (x3): 12.8 KB (x3) -- prefilled; 80 rows: 128 KB and more -- row by row
    lengths = np.random.default_rng(len(side) + (width or 0)).integers(0, 400, 80 if big else 8)
    ds = Rows(lengths, width)
    padding = kpipe.Padding(length, side=side, value=-7, mask="mask", lengths="n", too_long="truncate",
                            multiple_of=8)
    batches = _samples.for_loader(ds, len(lengths), shuffle=False, seed=0, drop_remainder=False, has_hooks=False,
                                  options={"padding": padding, "lengths": lengths})
    batch = batches[(0, 0, None)]
    want = _reference(ds, list(range(len(lengths))), padding)
    assert (batch["ids"].nbytes > _padding._PREFILL_BYTES) == big
    assert batch.keys() == want.keys()
    for key in want:
        assert batch[key].dtype == want[key].dtype and batch[key].shape == want[key].shape, key
        np.testing.assert_array_equal(batch[key], want[key], err_msg=key)


def test_prefilled_rows_carry_nothing_over_between_batches():
    # the same slot-sized arrays reused batch after batch: every pad position is the pad again
    lengths = [5, 1, 9, 2, 9, 0, 3, 9]
    ds = Rows(lengths)
    padding = kpipe.Padding(9, value=-1)
    with kpipe.ProcessLoader.from_samples(ds, 2, padding=padding, workers=1) as loader:
        for _ in range(2):
            for i in range(len(loader)):
                batch = loader[i]
                want = _reference(ds, [2 * i, 2 * i + 1], padding)
                np.testing.assert_array_equal(batch["ids"], want["ids"])


@pytest.mark.parametrize("label, first, accepted", [
    (lambda j: np.int64(j) if j == 2 else np.int32(j), np.int32, False),  # another NumPy type
    (lambda j: np.float32(j) if j == 2 else np.int32(j), np.int32, False),
    (lambda j: j, np.int64, True),  # Python ints: int64 throughout
    (lambda j: np.int64(j) if j == 2 else j, np.int64, True),
    (lambda j: np.array(j, np.int32) if j == 2 else np.int32(j), np.int32, True),  # a 0-d array of the type
    (lambda j: np.array([j], np.int32) if j == 2 else np.int32(j), np.int32, False),  # another shape
])
def test_labels_of_another_type_are_named(label, first, accepted):
    ds = Rows([3, 4, 5, 6], labels=label)
    batches = _samples.for_loader(ds, 4, shuffle=False, seed=0, drop_remainder=False, has_hooks=False,
                                  options={"padding": kpipe.Padding()})
    if accepted:
        batch = batches[(0, 0, None)]
        assert batch["label"].dtype == np.dtype(first) and batch["label"].tolist() == [0, 1, 2, 3]
        return
    with pytest.raises(BatchStructureError, match=r"Sample 2 of `Rows` has sample\['label'\] with shape .* but sample 0 "
                                                  r"of the same batch had \(\) and int32 \(not padded"):
        batches[(0, 0, None)]
