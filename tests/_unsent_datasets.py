"""Datasets whose class is imported from this module by the workers (sent by reference):
state kept on the class or in a module global does not travel (kpipe/_engine/_unsent.py)."""

import numpy as np

OFFSET = {"v": 0}


class ClassState:
    scale = 1

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.array([100 * self.scale + 10 * OFFSET["v"] + i])

    def on_epoch_end(self):
        type(self).scale += 1


class GlobalState(ClassState):
    def on_epoch_end(self):
        OFFSET["v"] += 1
