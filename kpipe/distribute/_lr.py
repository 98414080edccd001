"""The linear scaling rule of Goyal et al. (2017), "Accurate, Large Minibatch SGD"."""

import numbers


def scaled_learning_rate(base_lr: float, base_batch: int, global_batch: int) -> float:
    """Scales a learning rate tuned for `base_batch` to `global_batch` samples per step.

    Linear rule: `base_lr * global_batch / base_batch`. Pair it with
    `kpipe.callbacks.Warmup` for the first epochs, as the paper does (5 epochs of warmup
    for ImageNet with global batches up to 8k). Does not import TensorFlow.

    Args:
        base_lr: Learning rate that works for `base_batch`. Must be > 0.
        base_batch: The batch size `base_lr` was tuned for. Must be > 0.
        global_batch: Samples per optimizer step over all replicas and workers (e.g.
            per-replica batch x `strategy.num_replicas_in_sync`). Must be > 0.

    Returns:
        The scaled learning rate, a float.

    Raises:
        ValueError: An argument is not a positive number.

    Example:

    >>> scaled_learning_rate(0.1, base_batch=256, global_batch=1024)
    0.4
    """
    for name, value in (("base_lr", base_lr), ("base_batch", base_batch),
                        ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}.")
    return float(base_lr) * float(global_batch) / float(base_batch)
