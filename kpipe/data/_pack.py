"""`kpipe.data.pack`: an image folder into sharded HDF5 files of encoded JPEG bytes.

NOTE [ Packed format ]
Each shard `<prefix>-NNNNN-of-MMMMM.h5` holds, for its files in folder order:

    bytes        uint8: every image's encoded bytes (the file's own, or re-encoded), end to end
    offsets      int64, one more than images: image i is bytes[offsets[i]:offsets[i + 1]]
                 (a block of images is one contiguous read; h5py's variable-length
                 arrays cost ~0.2 ms an image to read, 4x reading the files themselves)
    labels       int32: the class's position in `class_names`
    names        variable-length str: the file's path relative to the folder
    attrs        class_names (JSON list), format ("kpipe-packed-1"), complete (set last)

A shard is written as `<name>.partial` and renamed when complete, so an interrupted run
resumes where it stopped: complete shards whose attrs match this run's are kept. One file
per thousand images means one `open` per shard instead of one per image, which is what
network file systems charge for. Reading: `kpipe.data.from_packed`.
"""

import io
import json
import os
import sys
import time

import numpy as np

FORMAT = "kpipe-packed-2"
_JPEG_MAGIC = b"\xff\xd8\xff"


def pack(directory, output_prefix, *, max_side=None, quality=90, shard_size=1000, class_names=None,
         extensions=None, validate=True, on_error="raise", verbose=True):
    """Writes the image folder `directory` into sharded HDF5 files of encoded JPEG bytes.

    The folder is read as `from_files` reads it (one sub-folder per class). Each image is
    checked by decoding it (PIL) unless `validate=False`; with `max_side` it is re-encoded
    as a JPEG of at most `max_side` pixels on its longer side (FFCV's `max_resolution`:
    smaller files decode faster; JPEGs are decoded in PIL's draft mode at the nearest
    larger DCT scale first). Otherwise JPEG files keep their bytes and other formats are
    re-encoded as JPEG at `quality`. Pixels are stored as the file has them (EXIF
    orientation is not applied, as `from_files` and Keras do not).

    Args:
        directory: The image folder.
        output_prefix: Path prefix of the shards, e.g. "packed/train" writes
            "packed/train-00000-of-00003.h5", ...
        max_side: Re-encode images whose longer side exceeds this. Defaults to None.
        quality: JPEG quality of re-encoded images. Defaults to 90.
        shard_size: Images per shard. Defaults to 1000.
        class_names: As in `from_files`. Defaults to None (every sub-folder, sorted).
        extensions: As in `from_files`. Defaults to None (its defaults).
        validate: Decode every image before storing it. Defaults to True.
        on_error: A file that cannot be read or decoded: "raise" stops with an error naming
            it; "skip" leaves it out and prints its name and the count so far. Defaults to
            "raise".
        verbose: Print one line per shard. Defaults to True.

    Returns:
        A dict: `shards` (paths), `images` (stored), `skipped` (paths), `reused` (shards
        kept from an earlier run), `class_names`.

    Raises:
        ValueError: for an undecodable file with `on_error="raise"` (naming it), or a bad
            argument.

    Example:

    >>> import os, tempfile, numpy as np, PIL.Image, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> for c in ("cat", "dog"):
    ...     os.makedirs(os.path.join(tmp.name, "photos", c))
    ...     PIL.Image.fromarray(np.zeros((40, 60, 3), "uint8")).save(os.path.join(tmp.name, "photos", c, "0.jpg"))
    >>> out = kpipe.data.pack(os.path.join(tmp.name, "photos"), os.path.join(tmp.name, "packed"), max_side=32, verbose=False)
    >>> out["images"], len(out["shards"]), out["class_names"]
    (2, 1, ['cat', 'dog'])
    >>> ds = kpipe.data.from_packed(out["shards"], image_size=(16, 16))
    >>> [(image.shape, int(label)) for image, label in ds.as_numpy_iterator()]
    [((16, 16, 3), 0), ((16, 16, 3), 1)]
    >>> tmp.cleanup()
    """
    import h5py

    from kpipe.data._files import _DEFAULT_EXTENSIONS, list_files

    try:
        import PIL.Image  # noqa: F401
    except ImportError as e:
        raise ImportError("kpipe.data.pack needs Pillow to check and re-encode images: pip install 'kpipe[pack]'") from e

    if max_side is not None and (not isinstance(max_side, int) or isinstance(max_side, bool) or max_side < 8):
        raise ValueError(f"`max_side` must be an integer >= 8 or None. Received: max_side={max_side!r}.")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"`quality` must be an integer in [1, 100]. Received: quality={quality!r}.")
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ValueError(f"`shard_size` must be an integer >= 1. Received: shard_size={shard_size!r}.")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"`on_error` must be 'raise' or 'skip'. Received: on_error={on_error!r}.")
    directory = os.fsdecode(directory)
    names, paths, labels = list_files(directory, class_names, extensions or _DEFAULT_EXTENSIONS)
    output_prefix = os.fsdecode(output_prefix)
    parent = os.path.dirname(output_prefix)
    if parent:
        os.makedirs(parent, exist_ok=True)
    count = max(1, -(-len(paths) // shard_size))
    settings = json.dumps({"max_side": max_side, "quality": quality, "shard_size": shard_size, "validate": validate,
                           "files": len(paths)})
    shards, skipped, reused, stored = [], [], 0, 0
    for s in range(count):
        path = f"{output_prefix}-{s:05d}-of-{count:05d}.h5"
        shards.append(path)
        if os.path.exists(path):
            with h5py.File(path, "r") as f:
                if f.attrs.get("complete", False) and f.attrs.get("settings") == settings:
                    reused += 1
                    stored += len(f["labels"])
                    skipped += json.loads(f.attrs.get("skipped", "[]"))
                    continue
        t0 = time.perf_counter()
        blobs, kept_labels, kept_names = [], [], []
        for p, label in zip(paths[s * shard_size:(s + 1) * shard_size], labels[s * shard_size:(s + 1) * shard_size]):
            try:
                blob = _encoded(p, max_side, quality, validate)
            except Exception as e:  # noqa: BLE001 -- any failure to read or decode names the file
                if on_error == "raise":
                    raise ValueError(
                        f"kpipe pack: cannot read or decode image file {p!r} ({type(e).__name__}: {e}). Remove or "
                        "replace it, or pass on_error='skip' (--on-error skip) to leave it out."
                    ) from e
                skipped.append(p)
                print(f"kpipe pack: skipped {p!r} ({type(e).__name__}: {e}) - {len(skipped)} skipped so far.", file=sys.stderr)
                continue
            blobs.append(np.frombuffer(blob, np.uint8))
            kept_labels.append(label)
            kept_names.append(os.path.relpath(p, directory))
        partial = path + ".partial"
        with h5py.File(partial, "w") as f:
            offsets = np.zeros(len(blobs) + 1, np.int64)
            np.cumsum([len(b) for b in blobs], out=offsets[1:])
            f.create_dataset("bytes", data=np.concatenate(blobs) if blobs else np.zeros(0, np.uint8))  # contiguous
            f.create_dataset("offsets", data=offsets)
            f.create_dataset("labels", data=np.asarray(kept_labels, np.int32))
            f.create_dataset("names", data=np.asarray(kept_names, dtype=object), dtype=h5py.string_dtype())
            f.attrs["class_names"] = json.dumps(names)
            f.attrs["format"] = FORMAT
            f.attrs["settings"] = settings
            f.attrs["skipped"] = json.dumps([p for p in skipped if p in paths[s * shard_size:(s + 1) * shard_size]])
            f.attrs["complete"] = True
        os.replace(partial, path)
        stored += len(blobs)
        if verbose:
            mb = sum(len(b) for b in blobs) / 1e6
            print(f"kpipe pack: {path}: {len(blobs)} images, {mb:.1f} MB, {time.perf_counter() - t0:.1f} s", flush=True)
    return {"shards": shards, "images": stored, "skipped": skipped, "reused": reused, "class_names": list(names)}


def _encoded(path, max_side, quality, validate):
    """Returns the bytes to store for the image file `path`; raises if it is not an image."""
    from PIL import Image

    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError("empty file")
    is_jpeg = data[:3] == _JPEG_MAGIC
    if not validate and is_jpeg and max_side is None:
        return data
    with Image.open(io.BytesIO(data)) as image:
        resize = max_side is not None and max(image.size) > max_side
        if resize and is_jpeg:
            image.draft("RGB", (max_side, max_side))  # DCT-domain downscale, still >= max_side
        image.load()  # decodes: a truncated or corrupt file raises here
        if is_jpeg and not resize:
            return data  # the file's own bytes
        return _save(image, max_side, quality)


def _save(image, max_side, quality):
    from PIL import Image

    image = image.convert("RGB")
    if max_side is not None and max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()
