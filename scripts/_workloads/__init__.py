"""Workloads of scripts/bench_loaders.py that live in a file of their own.

`WORKLOADS` maps a workload's name to its module (under this package), which defines
`HELP` (one line), `add_arguments(parser)` and `run(args, workers, repeats, quick) -> rows`
(each row a dict with "workload", "loader", "rate", ...). bench_loaders.py runs the ones
named in `--workloads`; each of their loader rows runs in a fresh process of its own.
"""

import importlib

WORKLOADS = {"jpeg": "jpeg"}
WORKLOADS["text"] = "text"  # variable-length token ids (issue 46; over scripts/bench_varlen.py)
WORKLOADS["audio"] = "audio"  # variable-length waveforms (issue 46; likewise)


def load(name):
    """Returns the module of workload `name`."""
    return importlib.import_module(f"_workloads.{WORKLOADS[name]}")
