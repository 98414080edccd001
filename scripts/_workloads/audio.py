"""The audio workload of scripts/bench_loaders.py (issue 46): float32 waveforms of 1-10 s
at 16 kHz, batch 8, bucketed by length (2, 4, 6, 8 s); the same rows and method as the
text workload (text.py, over scripts/bench_varlen.py).
"""

from _workloads import text

HELP = "variable-length float32 waveforms padded in length buckets (kpipe, bare processes, tf.data, torch, grain)"
NAME = "audio"


def add_arguments(parser):
    text.add_arguments(parser, NAME)


def run(args, workers, repeats, quick):
    return text.run(args, workers, repeats, quick, NAME)


def print_rows(rows, workers, repeats):
    text.print_rows(rows, workers, repeats, NAME)
