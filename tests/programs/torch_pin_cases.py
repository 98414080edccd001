"""The ahead copy (kpipe/_torch_pin.py) inside `fit()` on KERAS_BACKEND=torch, with the CPU
as the device (the test sets KPIPE_TORCH_PIN=cpu), run by tests/test_backend_torch.py:

    python torch_pin_cases.py --out D

`fit()` for 2 epochs over the whole loader, then with `steps_per_epoch=5` of 12 (Keras
drops each epoch's iterator with batches read ahead and not taken): the record lists the
ahead-copy threads left after each `fit()` (garbage collected) and after the loader closed,
the slots held then, and the weights of the whole-epoch run against plain Keras's. Writes
`_outputs.write(D/threads, 0, record, arrays)`.
"""

import argparse
import gc
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _outputs  # noqa: E402
from jax_feed_cases import Distinct, build  # noqa: E402


def pin_threads():
    return sum(t.name == "kpipe-torch-pin" for t in threading.enumerate())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import kpipe
    from kpipe import _stream

    record, arrays = {"mode": os.environ.get("KPIPE_TORCH_PIN")}, {}
    plain = build()
    plain.fit(Distinct(), epochs=2, shuffle=False, verbose=0)
    for i, w in enumerate(plain.get_weights()):
        arrays[f"plain/{i}"] = w
    for name, steps in (("whole", None), ("partial", 5)):
        model = build()
        with kpipe.ProcessLoader(Distinct(), workers=2, max_queue_size=2) as loader:
            model.fit(loader, epochs=2, shuffle=False, verbose=0, steps_per_epoch=steps)
            gc.collect()
            record[f"{name}/threads_after_fit"] = pin_threads()
            record[f"{name}/slots_after_fit"] = _stream.source_of(loader).backend.slots_held()
        gc.collect()
        record[f"{name}/threads_after_close"] = pin_threads()
        for i, w in enumerate(model.get_weights()):
            arrays[f"{name}/{i}"] = w
    _outputs.write(os.path.join(args.out, "threads"), 0, record, arrays)


if __name__ == "__main__":
    main()
