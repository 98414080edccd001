"""What `BackupAndRestore` saves besides `model.save_weights`: the states of the model's
random seed generators.

`model.save_weights` writes the model's weights and the optimizer's variables (its
`iterations`, its learning-rate variable, its slots), but not the `state` variables of
the `keras.random.SeedGenerator`s that Dropout, GaussianNoise, SpatialDropout, the random
preprocessing layers (RandomFlip, RandomCrop, ...) and any layer or model of the user's
own draw their randomness from: a resumed run would draw other masks and end with other
weights. The states are a few integers each; they go into the backup's metadata, in the
order the model's layers are flattened (the same for the same model code in any process,
whatever names Keras gave the layers).
"""

import logging
from typing import List, Optional

import keras
import numpy as np

from kpipe import _backends

logger = logging.getLogger("kpipe.callbacks")


def seed_generators(model) -> List:
    """The seed generators of `model` and of its layers, nested ones included, each once."""
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True):  # noqa: SLF001 -- Keras >= 3.0
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def random_state(model) -> List[List[int]]:
    """The state of each of `model`'s seed generators (JSON-serialisable)."""
    return [np.asarray(_backends.numpy_value(g.state)).tolist() for g in seed_generators(model)]


def restore_random_state(model, saved: Optional[List], backup: str) -> None:
    """Puts `model`'s seed generators back on the states `saved` in `backup`.

    Raises:
        ValueError: the backup recorded another number of seed generators, or states of
            another shape, than the model has (another model wrote it).
    """
    generators = seed_generators(model)
    if saved is None:
        if generators:
            logger.warning("BackupAndRestore: backup %s recorded no random state (written by an "
                           "older kpipe); the model's %d random layer(s) draw other numbers than "
                           "the interrupted run would have.", backup, len(generators))
        return
    shapes = [tuple(g.state.shape) for g in generators]
    saved_shapes = [np.shape(values) for values in saved]
    if shapes != saved_shapes:
        raise ValueError(
            f"The backup {backup} recorded {len(saved)} random seed generator state(s) of shapes "
            f"{saved_shapes}, but the model has {len(generators)} of shapes {shapes}. Received: a "
            "model with other random layers than the one that wrote the backup. Build the same "
            "model as the interrupted run, or delete the backup to start over.")
    for generator, values in zip(generators, saved):
        dtype = keras.backend.standardize_dtype(generator.state.dtype)
        generator.state.assign(np.asarray(values, dtype=dtype))
