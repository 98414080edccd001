"""A subclass of a subclass of `keras.utils.PyDataset`, each in its own module."""

from _layouts import only_base


class SubSub(only_base.OnlyBase):
    def __len__(self):
        return 3
