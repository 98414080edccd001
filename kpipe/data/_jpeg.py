"""Decoding with the crop fused in: only the crop of a JPEG is decoded, at a reduced scale
when it is much larger than the output.

NOTE [ Fused decode-time augmentation ]
`crop="random"` is the random-resized crop of Inception / Goyal et al. (torchvision's
`RandomResizedCrop`): a window of `scale` (fraction of the area) and `ratio` (width /
height) drawn by `tf.image.stateless_sample_distorted_bounding_box` (10 attempts, the whole
image when none fits), from the JPEG's header alone (`extract_jpeg_shape`); then

    window >= 2x the output on both sides   decode the whole image at 1/2, 1/4 or 1/8 scale
                                            in the DCT domain (`decode_jpeg(ratio=r)`, the
                                            largest r keeping the window >= the output), slice
    otherwise                               `decode_and_crop_jpeg`: only the window's rows and
                                            columns go through the inverse DCT

and a bilinear resize to `image_size`, then a horizontal flip with probability 1/2 if
`flip`. `crop="center"` is the evaluation crop: the central square of side
`center_fraction` x the shorter side (0.875: 224 of 256), decoded the same way. Every draw
is a stateless op seeded by `(epoch key, sample id)`, so a sample's crop depends on the
seed, the epoch and the sample only (not on threads, shards or workers). A file that is not
a JPEG (its first bytes are not FF D8 FF: PNG, GIF, BMP, WebP, whatever its name says) is
decoded whole with `decode_image` and cropped with the same window.
"""

import dataclasses
from typing import Optional, Tuple

CROPS = (None, "random", "center")
_JPEG_MAGIC = b"\xff\xd8\xff"
_DCT_RATIOS = (8, 4, 2)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """How one encoded image becomes a sample (see the note above)."""

    image_size: Optional[Tuple[int, int]]
    channels: int = 3
    crop: Optional[str] = None
    scale: Tuple[float, float] = (0.08, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    center_fraction: float = 0.875

    @property
    def random(self):
        """Whether the output depends on the sample's seed."""
        return self.crop == "random" or self.flip

    def blank(self):
        """A zero image of the output's dtype (the end sentinel of `_decoded.checked`)."""
        import tensorflow as tf

        if self.image_size is None:
            return tf.zeros([0, 0, self.channels], tf.uint8)
        return tf.zeros(list(self.image_size) + [self.channels], tf.float32)

    def decode(self, data, seed=None):
        """Returns the uint8 image (or crop) of the encoded bytes `data`, not yet resized;
        `seed` is an int64 `[2]` or None. The step that can fail on a bad file."""
        import tensorflow as tf

        if self.crop is None:
            return tf.io.decode_image(data, channels=self.channels, expand_animations=False)
        if self.channels == 4:  # decode_and_crop_jpeg gives 1 or 3 channels: decode whole
            return self._whole(data, seed)
        is_jpeg = tf.equal(tf.strings.substr(data, 0, 3), _JPEG_MAGIC)
        return tf.cond(is_jpeg, lambda: self._jpeg(data, seed), lambda: self._whole(data, seed))

    def finish(self, image, seed=None):
        """Returns the decoded `image` resized to `image_size` (float32) and flipped."""
        import tensorflow as tf

        if self.image_size is None:
            return image
        image = tf.image.resize(image, self.image_size)
        if self.flip:
            flip_seed = tf.random.experimental.stateless_fold_in(seed, 2)
            image = tf.cond(tf.random.stateless_uniform([], flip_seed) < 0.5, lambda: tf.reverse(image, [1]), lambda: image)
        return image

    def __call__(self, data, seed=None):
        """Returns the sample of the encoded bytes `data`: `finish(decode(data, seed), seed)`."""
        return self.finish(self.decode(data, seed), seed)

    def _window(self, shape, seed):
        """`(begin [y, x], size [h, w])` of the crop in an image of `shape` [h, w, ...]."""
        import tensorflow as tf

        if self.crop == "center":
            hw = tf.cast(shape[:2], tf.float32)
            side = tf.maximum(1, tf.cast(self.center_fraction * tf.reduce_min(hw), tf.int32))
            size = tf.stack([side, side])
            return (shape[:2] - size) // 2, size
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            shape, tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=tf.random.experimental.stateless_fold_in(seed, 1),
            min_object_covered=0.0, aspect_ratio_range=self.ratio, area_range=self.scale, max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return begin[:2], size[:2]

    def _jpeg(self, data, seed):
        import tensorflow as tf

        shape = tf.image.extract_jpeg_shape(data)
        begin, size = self._window(shape, seed)
        # One Case op: 0 decodes only the window, 1..3 the whole image at 1/2, 1/4, 1/8 scale.
        out = tf.constant(self.image_size, tf.int32)
        branch = tf.add_n([tf.cast(tf.reduce_all(size >= r * out), tf.int32) for r in _DCT_RATIOS])
        branches = [lambda: tf.io.decode_and_crop_jpeg(data, tf.concat([begin, size], 0), channels=self.channels)]
        branches += [lambda r=r: self._reduced(data, begin, size, r) for r in sorted(_DCT_RATIOS)]
        return tf.switch_case(branch, branches)

    def _reduced(self, data, begin, size, r):
        import tensorflow as tf

        image = tf.io.decode_jpeg(data, channels=self.channels, ratio=r)
        return image[begin[0] // r:(begin[0] + size[0]) // r, begin[1] // r:(begin[1] + size[1]) // r]

    def _whole(self, data, seed):
        import tensorflow as tf

        image = tf.io.decode_image(data, channels=self.channels, expand_animations=False)
        begin, size = self._window(tf.shape(image), seed)
        return image[begin[0]:begin[0] + size[0], begin[1]:begin[1] + size[1]]


def check_augment_args(image_size, crop, scale, ratio, flip, center_fraction):
    """Raises ValueError naming the argument for an invalid crop setting."""
    if crop not in CROPS:
        raise ValueError(
            f"`crop` must be one of {CROPS}. Received: crop={crop!r}. Use 'random' for the "
            "random-resized crop of training, 'center' for evaluation, None to resize whole images."
        )
    if crop is not None and image_size is None:
        raise ValueError(f"`crop={crop!r}` needs an `image_size` to resize the crop to. Received: image_size=None.")
    if flip and image_size is None:
        raise ValueError("`flip=True` needs an `image_size`. Received: image_size=None.")
    for name, value, lo, hi in (("scale", scale, 0.0, 1.0), ("ratio", ratio, 0.0, float("inf"))):
        if (not isinstance(value, (tuple, list)) or len(value) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
                or not lo < value[0] <= value[1] <= hi):
            raise ValueError(
                f"`{name}` must be (low, high) with {lo:g} < low <= high <= {hi:g}. Received: {name}={value!r}."
            )
    if not isinstance(flip, bool):
        raise ValueError(f"`flip` must be True or False. Received: flip={flip!r}.")
    if not isinstance(center_fraction, (int, float)) or isinstance(center_fraction, bool) or not 0 < center_fraction <= 1:
        raise ValueError(f"`center_fraction` must be in (0, 1]. Received: center_fraction={center_fraction!r}.")
