"""`kpipe launch`: run a local multi-worker job, one `TF_CONFIG` per process.

    kpipe launch --workers 2 -- python train.py --epochs 3
    kpipe launch --print-tf-config 10.0.0.1:2222,10.0.0.2:2222
    kpipe launch --workers 2 --ps 1 -- python train.py      # parameter servers (+ a chief)
    kpipe launch --chief --ps 1 --print-tf-config h0:2222,h1:2222,h2:2222,h3:2222

From a notebook, run it through `subprocess` (the launcher then owns the processes and
stops them all when one fails or the cell is interrupted):

    subprocess.run([sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--",
                    sys.executable, "train.py"], check=True)

Does not import TensorFlow.
"""

import argparse
import sys

HELP = "run a local multi-worker job, one TF_CONFIG per process"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `kpipe launch`'s options to `parser`."""
    parser.add_argument("--workers", type=int, default=2,
                        help="number of local worker processes (default: 2)")
    parser.add_argument("--ps", type=int, default=0, metavar="M",
                        help="number of parameter-server tasks; implies --chief, and the job "
                             "follows parameter-server rules (see below) (default: 0)")
    parser.add_argument("--chief", action="store_true",
                        help="run a chief task besides the workers (implied by --ps)")
    parser.add_argument("--port", type=int, default=None,
                        help="first port; workers listen on PORT, PORT+1, ... "
                             "(default: free ports)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address written into TF_CONFIG, under which the workers reach "
                             "each other (default: 127.0.0.1). TensorFlow's servers listen "
                             "on every network interface whatever it is; kpipe warns when they "
                             "do (docs/security.md)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop every worker after SECONDS and exit with 124")
    parser.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping (default: 10)")
    parser.add_argument("--print-tf-config", metavar="HOST:PORT,...", default=None,
                        help="print the TF_CONFIG of each host of a real multi-host job "
                             "and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run, after `--`")
    parser.epilog = ("Each worker gets TF_CONFIG (worker i of N; worker 0 is the chief) and "
                     "KPIPE_LAUNCH_WORKER=i; its output lines are prefixed with [worker i]. "
                     "When one worker fails, the others are stopped and its exit code is "
                     "returned; Ctrl-C is forwarded to every worker. Unless --verbose, "
                     "workers get TF_CPP_MIN_LOG_LEVEL=1 (if it is not set) and TensorFlow's "
                     "start-up lines (CUDA, CPU features) are left out of their output. "
                     "With --ps M: tasks run in the order chief, workers, ps (prefixes "
                     "[chief], [worker i], [ps i]; with --print-tf-config, list the addresses "
                     "in that order); the chief's exit ends the job with its status and stops "
                     "the servers; a worker may die (the chief re-runs its steps) unless none "
                     "is left; a ps task's death gives the chief --grace seconds to report it.")


def run(args: argparse.Namespace) -> int:
    """Runs `kpipe launch`; returns the exit code."""
    from kpipe.distribute import _launcher

    if args.print_tf_config is not None:
        try:
            addresses = _launcher.parse_addresses(args.print_tf_config)
        except ValueError as e:
            print(f"kpipe launch: --print-tf-config: {e}", file=sys.stderr)
            return 2
        if args.ps or args.chief:
            try:
                print(_launcher.format_role_tf_configs(addresses, chief=True, ps=args.ps))
            except ValueError as e:
                print(f"kpipe launch: --print-tf-config: {e}", file=sys.stderr)
                return 2
        else:
            print(_launcher.format_tf_configs(addresses))
        return 0
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("kpipe launch: no command given. Usage: kpipe launch --workers 2 -- python "
              "train.py", file=sys.stderr)
        return 2
    from kpipe._cli import _quiet

    verbose = getattr(args, "verbose", False)
    try:
        with _quiet.kpipe_warnings_as_lines("kpipe launch"):
            result = _launcher.launch(
                command, workers=args.workers, ps=args.ps, chief=True if args.chief else None,
                port=args.port, host=args.host,
                timeout_s=args.timeout, grace_s=args.grace,
                env=None if verbose else _quiet.quiet_env(),
                line_filter=None if verbose else _quiet.startup_noise_filter())
    except ValueError as e:
        print(f"kpipe launch: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kpipe launch: cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127
    def task(i):
        return result.tasks[i] if result.tasks else f"worker {i}"

    left = ""
    if result.left_first is not None:
        left = (f"{task(result.left_first)} exited first, with status 0, while the others "
                "were still running (a worker that leaves a multi-worker job early makes "
                "the others' collective operations fail); then ")
    if result.failed_worker is not None:
        print(f"kpipe launch: {left}{task(result.failed_worker)} exited with status "
              f"{result.returncode}; stopped the others.", file=sys.stderr)
    elif result.timed_out:
        print(f"kpipe launch: {left}timed out after {args.timeout} s; stopped every worker.",
              file=sys.stderr)
    return result.returncode
