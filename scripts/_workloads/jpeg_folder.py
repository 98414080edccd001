"""The jpeg workload's image folder, made from a photo a package ships (no download).

The photo is matplotlib's `sample_data/grace_hopper.jpg` (512x600) when matplotlib is
installed; otherwise a PIL-synthesised picture (smooth gradients, shapes, noise).
Each file is a different crop of it, scaled, possibly flipped and tinted, re-encoded as a
JPEG at `quality`, about `size` (width, height) pixels, one sub-folder per class.
"""

import os

import numpy as np

PHOTO = "matplotlib sample_data/grace_hopper.jpg"


def source_photo():
    """Returns `(PIL image, description)`: the shipped photo, or a synthesised one."""
    from PIL import Image, ImageDraw, ImageFilter

    try:
        import matplotlib

        path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data", "grace_hopper.jpg")
        if os.path.exists(path):
            return Image.open(path).convert("RGB"), PHOTO
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    h, w = 600, 800
    y, x = np.mgrid[0:h, 0:w] / np.array([h, w])[:, None, None]
    base = np.stack([120 + 100 * x, 90 + 120 * y, 160 - 80 * x * y], -1)
    image = Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(60):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        r = int(rng.integers(10, 120))
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    return image.filter(ImageFilter.GaussianBlur(2)), "PIL-synthesised (matplotlib not installed)"


def make_folder(root, n, classes=10, size=(500, 375), quality=90, seed=0):
    """Writes `n` JPEGs under `root/<class>/`; returns the description of the source photo."""
    from PIL import Image

    photo, what = source_photo()
    rng = np.random.default_rng(seed)
    pw, ph = photo.size
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class_{c:03d}"), exist_ok=True)
    for i in range(n):
        scale = rng.uniform(0.55, 1.0)
        cw, ch = int(pw * scale), int(pw * scale * size[1] / size[0])
        ch = min(ch, ph)
        x0, y0 = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
        im = photo.crop((x0, y0, x0 + cw, y0 + ch)).resize(size, Image.BILINEAR)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(im, np.float32) * rng.uniform(0.8, 1.2, 3)
        im = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))
        im.save(os.path.join(root, f"class_{i % classes:03d}", f"{i:06d}.jpg"), quality=quality)
    return what
