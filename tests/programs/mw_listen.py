"""A MultiWorkerMirroredStrategy worker that only starts its servers: `python mw_listen.py STOP_FILE`.

Started by `kpipe launch` in `tests/test_ports.py`. Prints `ready <index> <address>` once the
strategy (and so TensorFlow's gRPC server from `TF_CONFIG`) is up, then waits until STOP_FILE
exists (at most 120 s) so that the test can look at the sockets it listens on.
"""

import json
import os
import sys
import time


def main(argv=None):
    stop_file = (sys.argv[1:] if argv is None else argv)[0]
    import tensorflow as tf

    tf.distribute.MultiWorkerMirroredStrategy()
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    print("ready", index, config["cluster"]["worker"][index], flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
