"""A dataset that is no PyDataset and imports no keras, in a package whose `__init__` does."""

from _layouts._flag import tf_flag


class Plain:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return tf_flag(i)
