"""`fit(steps_per_epoch=...)` through kpipe on KERAS_BACKEND=torch, against plain Keras, run
by tests/test_backend_torch.py with the ahead copy (kpipe/_torch_pin.py) on the CPU
(`KPIPE_TORCH_PIN=cpu`) and off (`0`):

    python torch_steps_cases.py --out D

`fit(epochs=3, steps_per_epoch=5)` over a PyDataset of 12 distinct batches: Keras carries its
iterator over the epoch ends and runs out in the third epoch, while the ahead copy's thread
has read past each epoch's end. The record holds each epoch's loss and the final weights,
of plain Keras and of a ProcessLoader; writes
`_outputs.write(D/steps, 0, record, arrays)`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _outputs  # noqa: E402
from jax_feed_cases import Distinct, build  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import kpipe

    record, arrays = {"mode": os.environ.get("KPIPE_TORCH_PIN")}, {}
    fit = {"epochs": 3, "steps_per_epoch": 5, "shuffle": False, "verbose": 0}
    plain = build()
    record["plain/loss"] = plain.fit(Distinct(), **fit).history["loss"]
    model = build()
    with kpipe.ProcessLoader(Distinct(), workers=2, max_queue_size=2) as loader:
        record["kpipe/loss"] = model.fit(loader, **fit).history["loss"]
    for name, m in (("plain", plain), ("kpipe", model)):
        for i, w in enumerate(m.get_weights()):
            arrays[f"{name}/{i}"] = w
    _outputs.write(os.path.join(args.out, "steps"), 0, record, arrays)


if __name__ == "__main__":
    main()
