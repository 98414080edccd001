"""A base class over `keras.utils.PyDataset` in its own module (the one that imports keras)."""

import keras

from _layouts._flag import tf_flag


class Base(keras.utils.PyDataset):
    def __init__(self, n=4, **kw):
        super().__init__(**kw)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return tf_flag(i)
