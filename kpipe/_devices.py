"""Device names as users write them ('/gpu:1') -> devices of this process."""


def available():
    """The names of this process's logical devices, e.g. ['/device:CPU:0', '/device:GPU:0']."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices()]


def local_device(name, *, require_index=False):
    """`/device:TYPE:INDEX` when `name` names a logical device of this process (no other
    job or task), else None. A name without an index means index 0, unless
    `require_index`."""
    import tensorflow as tf

    if not isinstance(name, str):
        return None
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        return None
    if not spec.device_type or (require_index and spec.device_index is None):
        return None
    if spec.job not in (None, "localhost") or (spec.task or 0) != 0:
        return None
    canonical = f"/device:{spec.device_type.upper()}:{spec.device_index or 0}"
    return canonical if canonical in available() else None
