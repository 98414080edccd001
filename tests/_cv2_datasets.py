"""A dataset whose module imports OpenCV: a worker unpickling it imports cv2 then."""

import os

import cv2
import numpy as np


class Blurs:
    """Returns pid and `cv2.getNumThreads()` after a blur that runs OpenCV's pool."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        img = np.random.default_rng(i).random((256, 256), dtype=np.float32)
        cv2.GaussianBlur(img, (5, 5), 1.0)
        return np.array([os.getpid(), cv2.getNumThreads()], dtype=np.int64)
