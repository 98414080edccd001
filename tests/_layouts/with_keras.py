"""A dataset in a module that imports keras itself (the README's layout)."""

import keras

from _layouts._flag import tf_flag


class WithKeras(keras.utils.PyDataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return tf_flag(i)
