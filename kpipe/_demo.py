"""The built-in dataset of `kpipe demo`: synthetic, imbalanced image classification in HDF5.

TensorFlow-free on purpose: `DemoImages` is sent to `ProcessLoader` workers, which import
this module to unpickle it and must stay light. Keras objects (the model, the serial
`PyDataset` view) are built by `kpipe/_cli/demo.py`.
"""

import os

import numpy as np

IMAGE_SIZE = 32
CLASS_SHARES = (0.6, 0.25, 0.1, 0.05)  # imbalanced on purpose: class_weight matters
_COLOURS = np.array([[1.0, 0.1, 0.1], [0.1, 1.0, 0.1], [0.1, 0.1, 1.0], [1.0, 1.0, 0.1]])
_FORMAT_VERSION = 2
_CHUNK = 1024


def cache_dir():
    """Where generated data is kept: `$KPIPE_CACHE_DIR`, else `$XDG_CACHE_HOME/kpipe`,
    else `~/.cache/kpipe`. Created if missing."""
    path = os.environ.get("KPIPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kpipe"
    )
    os.makedirs(path, exist_ok=True)
    return path


def ensure_dataset(samples, *, seed=0):
    """Returns `(path, created)`: the demo HDF5 file for `samples` images, generated once.

    The file holds `images` (N, 32, 32, 3) uint8 and `labels` (N,) int64 with the class
    shares of `CLASS_SHARES`. It is written to a temporary name and renamed, so an
    interrupted run never leaves a truncated file behind.

    Raises:
        ValueError: if `samples` is smaller than 64.
    """
    import h5py

    if samples < 64:
        raise ValueError(f"`samples` must be >= 64 (one batch). Received: samples={samples}.")
    path = os.path.join(cache_dir(), f"demo-v{_FORMAT_VERSION}-{samples}x{IMAGE_SIZE}px-seed{seed}.h5")
    if os.path.exists(path):
        return path, False
    tmp = f"{path}.tmp{os.getpid()}"
    rng = np.random.default_rng(seed)
    labels = rng.choice(len(CLASS_SHARES), size=samples, p=CLASS_SHARES).astype("int64")
    try:
        with h5py.File(tmp, "w") as f:
            images = f.create_dataset("images", (samples, IMAGE_SIZE, IMAGE_SIZE, 3), dtype="uint8", chunks=(64, IMAGE_SIZE, IMAGE_SIZE, 3))
            for start in range(0, samples, _CHUNK):
                images[start : start + _CHUNK] = _draw(labels[start : start + _CHUNK], rng)
            f.create_dataset("labels", data=labels)
            f.attrs["class_shares"] = CLASS_SHARES
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path, True


def _draw(labels, rng):
    """Class c: a square of colour `_COLOURS[c]` at a random place, over textured noise."""
    n, s = len(labels), IMAGE_SIZE
    images = rng.normal(80, 25, size=(n, s, s, 3))
    side = s // 3
    corners = rng.integers(0, s - side, size=(n, 2))
    for i, (label, (r, c)) in enumerate(zip(labels, corners)):
        images[i, r : r + side, c : c + side] += 130 * _COLOURS[label]
    return np.clip(images, 0, 255).astype("uint8")


def class_weights(path):
    """`{class: weight}` from the file's labels: `n / (classes * count)`, balanced."""
    import h5py

    with h5py.File(path, "r") as f:
        labels = f["labels"][:]
    counts = np.bincount(labels, minlength=len(CLASS_SHARES))
    return {c: float(len(labels) / (len(counts) * max(n, 1))) for c, n in enumerate(counts)}


class DemoImages:
    """Batches of augmented images from the demo file; opens it lazily, once per process.

    `__getitem__` does what real pipelines do in Python: read a slice, convert to float,
    then per image a random crop from a padded copy, a flip, brightness/contrast jitter,
    a blur and noise. That costs more CPU than the demo model's step, which is the point.

    Args:
        path: The HDF5 file from `ensure_dataset`.
        batch_size: Images per batch. Defaults to 64.
        seed: Seed of the augmentation, combined with the batch index and epoch.
            Defaults to 0.
    """

    def __init__(self, path, batch_size=64, seed=0):
        import h5py

        self.path, self.batch_size, self.seed = path, batch_size, seed
        with h5py.File(path, "r") as f:
            self.samples = len(f["labels"])
        self.epoch = 0
        self._h5 = None

    def __len__(self):
        return self.samples // self.batch_size

    def __getitem__(self, i):
        import h5py

        if self._h5 is None:
            self._h5 = h5py.File(self.path, "r")
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        images = self._h5["images"][s].astype("float32") / 255.0
        labels = self._h5["labels"][s]
        rng = np.random.default_rng((self.seed, self.epoch, i))
        return np.stack([_augment(img, rng) for img in images]), labels

    def on_epoch_end(self):
        self.epoch += 1

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_h5"] = None  # an open h5py file cannot cross processes
        return state


def _augment(img, rng, pad=4):
    size = img.shape[0]
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
    r, c = rng.integers(0, 2 * pad + 1, size=2)
    out = padded[r : r + size, c : c + size]
    if rng.random() < 0.5:
        out = out[:, ::-1]
    out = (out - out.mean()) * rng.uniform(0.8, 1.2) + out.mean() + rng.uniform(-0.1, 0.1)
    out = (out + np.roll(out, 1, 0) + np.roll(out, -1, 0) + np.roll(out, 1, 1) + np.roll(out, -1, 1)) / 5.0
    out = out + rng.normal(0.0, 0.02, size=out.shape)
    return np.clip(out, 0.0, 1.0).astype("float32")


def demo_dataset(samples=8192, batch_size=64):
    """The demo's training data as a dataset factory: `kpipe bench kpipe._demo:demo_dataset`.

    Args:
        samples: Images in the (generated once, cached) file. Defaults to 8192.
        batch_size: Images per batch. Defaults to 64.

    Returns:
        A `DemoImages`.
    """
    return DemoImages(ensure_dataset(samples)[0], batch_size=batch_size)


def keras_view(dataset, **pydataset_kwargs):
    """The demo dataset as the plain `keras.utils.PyDataset` a training script would use.

    `pydataset_kwargs` (`workers`, `use_multiprocessing`, `max_queue_size`) go to Keras's
    own loader. Imports Keras, so call it in the training process only.
    """
    import keras

    class Images(keras.utils.PyDataset):
        def __init__(self, inner):
            super().__init__(**pydataset_kwargs)
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

        def on_epoch_end(self):
            self.inner.on_epoch_end()

    return Images(dataset)
