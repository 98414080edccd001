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


class DeviceNotFoundError(ValueError):
    """A strategy was asked for devices this process does not have.

    Raised by `kpipe.distribute.auto_strategy(devices=...)` before it builds a
    `MirroredStrategy` (whose `fit()` would hang on a missing device). Its message names
    the devices asked for that are missing, the devices found, and how to create more
    logical devices.

    Example:

    >>> import kpipe
    >>> try:
    ...     kpipe.distribute.auto_strategy(devices=["/cpu:0", "/cpu:7"])
    ... except kpipe.distribute.DeviceNotFoundError as e:
    ...     print(str(e).split(". ")[1])
    Received: devices=['/cpu:0', '/cpu:7']; not found: ['/cpu:7']
    """


def check_devices(devices, *, argument="devices"):
    """`devices` (device names as users write them) as a list, checked to exist here.

    Names of other jobs or tasks (`/job:worker/task:1/...`) are passed as they are.

    Raises:
        DeviceNotFoundError: a local name is not a logical device of this process.
    """
    import tensorflow as tf

    devices = list(devices)
    missing = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name) if isinstance(name, str) else None
        except (ValueError, TypeError):
            spec = None
        if spec is not None and (spec.job not in (None, "localhost") or (spec.task or 0) != 0):
            continue  # (another task's device: not this process's to check)
        if local_device(name) is None:
            missing.append(name)
    if missing:
        found = available()
        kinds = sorted({n.split(":")[-2] for n in found})
        raise DeviceNotFoundError(
            f"`{argument}` names devices this process does not have. Received: {argument}={devices!r}; "
            f"not found: {missing!r}. Devices found: {found!r} (types {kinds}). To run several "
            "replicas on one physical device, create logical devices at program start, before "
            "TensorFlow initialises (before any op runs or any strategy is made): "
            "tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], "
            "[tf.config.LogicalDeviceConfiguration()] * 2) makes '/cpu:0' and '/cpu:1' (for a GPU, "
            "give each a memory_limit). Or pass devices=None to use every GPU found.")
    return devices
