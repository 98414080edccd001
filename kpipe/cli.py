"""The `kpipe` console script: `kpipe {demo,bench,launch,data-service,pack} ...`.

Each subcommand lives in `kpipe/_cli/<name>.py`, which defines `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when their
subcommand runs, so `kpipe --help` and `kpipe launch` never import TensorFlow.

TensorFlow's start-up log (CUDA, oneDNN, CPU-feature lines) is hidden unless `--verbose`
(`kpipe --verbose demo` or `kpipe demo --verbose`) is given; see `kpipe/_cli/_quiet.py`.
"""

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "demo": ("kpipe._cli.demo", "train a small CNN on a built-in dataset, serial vs kpipe"),
    "bench": ("kpipe._cli.bench", "measure a dataset's loader throughput by worker count"),
    "launch": ("kpipe._cli.launch", "run a local multi-worker job, one TF_CONFIG per process"),
    "data-service": ("kpipe._cli.data_service", "start a tf.data service dispatcher or worker"),
    "pack": ("kpipe._cli.pack", "pack an image folder into sharded HDF5 files of JPEG bytes (resumable)"),
}


_VERBOSE_HELP = ("show TensorFlow's start-up log (CUDA, oneDNN, CPU-feature lines), which is "
                 "hidden by default")


def _build_parser(selected):
    parser = argparse.ArgumentParser(
        prog="kpipe", description="Keep accelerators busy: loaders, pipelines, data parallelism."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: `kpipe --verbose demo` is not undone by the subcommand's default.
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help=_VERBOSE_HELP)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def main(argv=None) -> int:
    """Runs the `kpipe` command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = _build_parser(selected if selected in _SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
