"""Datasets holding open handles (h5py objects, files, memmaps), for tests/test_handles.py."""

import os
import sys

import numpy as np

import keras


class Images(keras.utils.PyDataset):
    """The README's lazy-HDF5 class, with its bodies written out."""

    def __init__(self, path, batch_size, **kw):
        super().__init__(**kw)
        self.path, self.batch_size, self._h5 = path, batch_size, None   # open files lazily

    def _file(self):
        import h5py

        if self._h5 is None:
            self._h5 = h5py.File(self.path, "r")
        return self._h5

    def __len__(self):
        return len(self._file()["x"]) // self.batch_size

    def __getitem__(self, i):
        self._file()
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self._h5["x"][s], self._h5["y"][s]


class Nested:
    """h5py Datasets in a list and a dict attribute, and a text file opened for reading."""

    def __init__(self, path, labels_path, batch=4):
        import h5py

        f = h5py.File(path, "r")
        self.columns = [f["x"], f["y"]]
        self.by_name = {"x": f["x"], "attrs": f["x"].attrs}
        self.labels = open(labels_path)
        self.batch = batch

    def __len__(self):
        return len(self.columns[0]) // self.batch

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        self.labels.seek(0)
        names = self.labels.read().split()
        offset = float(self.by_name["attrs"]["offset"])
        y = np.array([int(names[j][1:]) for j in range(s.start, s.stop)])
        return self.by_name["x"][s] + offset, self.columns[1][s], y


class Rows:
    """Rows of an `np.memmap`; each batch also says whether the worker reads a memmap."""

    def __init__(self, mm, batch=8):
        self.mm, self.batch = mm, batch

    def __len__(self):
        return len(self.mm) // self.batch

    def __getitem__(self, i):
        rows = np.asarray(self.mm[i * self.batch:(i + 1) * self.batch])
        flags = np.array([isinstance(self.mm, np.memmap), self.mm.filename == os.path.abspath(self.mm.filename),
                          "tensorflow" in sys.modules])
        return rows, np.broadcast_to(flags, (len(rows), 3)).copy()


def make_images():
    """A factory for `kpipe bench`: `KPIPE_TEST_H5` names the file."""
    return Images(os.environ["KPIPE_TEST_H5"], 8)
