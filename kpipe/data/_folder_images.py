"""`kpipe.data.FolderImages`: an image folder's files decoded per sample in Python, for
`kpipe.ProcessLoader.from_samples` -- `PackedImages`' decoding without packing first.

NOTE [ Per-sample decoding of a folder ]
`FolderImages` is `PackedImages` (kpipe/data/_packed_images.py: crop window from the header,
reduced decoding in the DCT domain, the crop resized straight into the batch's row) whose
`read(j)` opens and reads file j instead of one `pread` from a shard. The folder is listed
as `from_files` lists it (one sub-folder per class, sorted, `extensions`), once, where the
object is made; workers get the list with the object. Files are not checked ahead: a file
that does not decode raises, in the worker, an error naming it (`from_files(...,
on_error="skip")` or `kpipe pack`'s validation find such files first). Measured on the jpeg
workload (1,280 JPEGs of ~500x375, random-resized crop + flip to 224x224, 2 workers): with
`decoder="simplejpeg"`, 2,334 images/s at 0.81 CPU ms an image, against 1,706 and 1.07 ms
for `pipeline(from_files(..., crop="random", flip=True))` (docs/guides/tf-data.md); a pack
at max side 256 read the same way ran 2.41x that.
"""

import os

import numpy as np

from kpipe.data._files import _DEFAULT_EXTENSIONS, list_files
from kpipe.data._packed_images import PackedImages


class FolderImages(PackedImages):
    """Map-style samples `(image, label)` of an image folder, decoded with PIL, OpenCV or simplejpeg.

    The folder is read as `kpipe.data.from_files` reads it (one sub-folder per class, class
    names sorted, labels their indices); `[j]` opens file j, decodes only what the crop needs,
    crops, resizes and flips, as `kpipe.data.PackedImages` does for a pack (same arguments,
    same draws from `(seed, epoch, j)`, epoch advanced by `on_epoch_end`; no TensorFlow). In
    `ProcessLoader.from_samples` each sample is written straight into the batch's shared
    memory (`kpipe_sample_into`). Files are not checked ahead: one that does not decode
    raises an error naming it, in the worker, when its sample is read. EXIF orientation is
    not applied (as `from_files` and Keras's `image_dataset_from_directory`). For millions of
    files on network storage, pack them (`kpipe pack`) and use `PackedImages`.

    Args:
        directory: The folder, with one sub-folder per class.
        image_size: `(height, width)` of the output. Defaults to (224, 224).
        crop: None (resize the whole image), "random" (random-resized crop) or "center".
            Defaults to "random".
        scale: With `crop="random"`, the crop's area range as a fraction of the image's.
            Defaults to (0.08, 1.0).
        ratio: With `crop="random"`, the crop's width / height range. Defaults to (3/4, 4/3).
        flip: Flip left-right with probability 1/2. Defaults to False.
        center_fraction: With `crop="center"`, the crop's side as a fraction of the shorter
            side. Defaults to 0.875.
        seed: Seed of the crops and flips. Defaults to None (one drawn here, shared by
            every process the object is sent to).
        decoder: "pil", "cv2" or "simplejpeg" (see `PackedImages`; "simplejpeg" is the
            fastest: `pip install kpipe[jpeg]`). Defaults to "pil".
        class_names: The classes to read, in label order (sub-folder names). Defaults to
            None (every sub-folder, sorted).
        extensions: File name endings read as images (case-insensitive). Defaults to
            `.jpg .jpeg .png .bmp .gif`.

    Attributes:
        class_names: The class names, in label order.
        paths: The image files, in sample order.
        labels: int32 label of every image.
        epoch: The epoch of the draws (0 first; `on_epoch_end` adds one).

    Raises:
        FileNotFoundError: if `directory` is not a folder.
        ValueError: if it holds no images, or an argument is invalid.
        ImportError: if the `decoder`'s package is not installed; the message names the
            extra that installs it.

    Example:

    >>> import os, tempfile, numpy as np, PIL.Image, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> for c in ("cat", "dog"):
    ...     os.makedirs(os.path.join(tmp.name, c))
    ...     for i in range(2):
    ...         PIL.Image.fromarray(np.full((60, 80, 3), 40 * i, "uint8")).save(os.path.join(tmp.name, c, f"{i}.jpg"))
    >>> images = kpipe.data.FolderImages(tmp.name, image_size=(32, 32), flip=True, seed=0)
    >>> images.class_names, len(images), [int(v) for v in images.labels]
    (['cat', 'dog'], 4, [0, 0, 1, 1])
    >>> with kpipe.ProcessLoader.from_samples(images, 2, shuffle=True, seed=0, workers=1) as loader:
    ...     x, y = loader[0]
    >>> x.shape, x.dtype
    ((2, 32, 32, 3), dtype('uint8'))
    >>> tmp.cleanup()
    """

    def __init__(self, directory, *, image_size=(224, 224), crop="random", scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                 flip=False, center_fraction=0.875, seed=None, decoder="pil", class_names=None,
                 extensions=_DEFAULT_EXTENSIONS):
        self._configure(image_size, crop, scale, ratio, flip, center_fraction, seed, decoder)
        if isinstance(extensions, str) or not all(isinstance(e, str) for e in extensions):
            raise ValueError(f"`extensions` must be a list of file name endings such as ['.jpg', '.png']. "
                             f"Received: extensions={extensions!r}.")
        self.directory = os.fspath(directory)
        self.class_names, paths, labels = list_files(self.directory, class_names, tuple(extensions))
        self.paths = list(paths)
        self.labels = np.asarray(labels, np.int32)

    def read(self, j):
        """Returns file `j`'s bytes."""
        if not 0 <= j < len(self.labels):
            raise IndexError(f"Image index {j} is out of range for {len(self.labels)} images in {self.directory!r}.")
        with open(self.paths[j], "rb") as f:
            return f.read()

    def _close(self):
        pass  # (no file stays open)

    def __getitem__(self, j):
        try:
            return super().__getitem__(j)
        except IndexError:
            raise
        except Exception as e:  # noqa: BLE001 - the file's or its decoder's error, re-raised naming the file
            raise self._failed(j, e) from e

    def kpipe_sample_into(self, j, out):
        try:
            return super().kpipe_sample_into(j, out)
        except IndexError:
            raise
        except Exception as e:  # noqa: BLE001 - as in __getitem__ (a wrong `out` is the caller's: kept)
            if isinstance(e, ValueError) and str(e).startswith("`out` must be"):
                raise
            raise self._failed(j, e) from e

    kpipe_sample_into.__doc__ = PackedImages.kpipe_sample_into.__doc__

    def _failed(self, j, e):
        path = self.paths[int(j)]
        return ValueError(f"Image {int(j)}, {path!r}, could not be read or decoded ({type(e).__name__}: {e}). Remove or replace the "
                          "file; `kpipe.data.from_files(directory, on_error='skip')` lists the files that fail in a pass.")
