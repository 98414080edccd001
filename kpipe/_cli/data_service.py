"""`kpipe data-service dispatcher|worker`: TensorFlow's tf.data service servers.

    kpipe data-service dispatcher --port 5050
    kpipe data-service worker --dispatcher 127.0.0.1:5050       # on each CPU host

Trainers then read through `kpipe.distribute.via_data_service(ds, "127.0.0.1:5050")`.
Each server runs until Ctrl-C or SIGTERM (or `--duration` seconds) and exits with 0.
"""

import argparse
import signal
import sys
import threading

HELP = "start a tf.data service dispatcher or worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `kpipe data-service`'s options to `parser`."""
    sub = parser.add_subparsers(dest="role", metavar="ROLE")
    sub.required = True
    dispatcher = sub.add_parser("dispatcher", help="hand out input-pipeline work to workers")
    dispatcher.add_argument("--port", type=int, default=0,
                            help="port to listen on (default: a free port, printed)")
    dispatcher.add_argument("--work-dir", default=None,
                            help="journal the dispatcher's state here so a restart resumes")
    worker = sub.add_parser("worker", help="run input pipelines for a dispatcher")
    worker.add_argument("--dispatcher", required=True, metavar="HOST:PORT",
                        help="the dispatcher's address")
    worker.add_argument("--port", type=int, default=0,
                        help="port to listen on (default: a free port, printed)")
    worker.add_argument("--host", default="127.0.0.1",
                        help="address under which the dispatcher and trainers reach this "
                             "worker (default: 127.0.0.1). The server listens on every "
                             "network interface whatever it is (docs/security.md)")
    for p in (dispatcher, worker):
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="show TensorFlow's start-up log, which is hidden by default")
        p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                       help="stop after SECONDS (default: run until Ctrl-C or SIGTERM)")


def run(args: argparse.Namespace) -> int:
    """Runs `kpipe data-service`; returns the exit code."""
    from kpipe._cli import _quiet
    from kpipe.distribute import _data_service

    try:  # the arguments first: a usage error costs no TensorFlow start-up
        _data_service._check_port(args.port)
        if args.role == "worker":
            _data_service._strip_protocol(args.dispatcher)
    except ValueError as e:
        print(f"kpipe data-service: {e}", file=sys.stderr)
        return 2
    _quiet.quiet_tensorflow(getattr(args, "verbose", False))
    try:
        with _quiet.kpipe_warnings_as_lines("kpipe data-service"):
            server = _start(args, _data_service)
    except ValueError as e:
        print(f"kpipe data-service: {e}", file=sys.stderr)
        return 2
    _wait_for_stop(args.duration)
    print("kpipe data-service: stopping", flush=True)
    del server
    return 0


def _start(args, _data_service):
    """Starts the server `args.role` names and prints where it listens."""
    if args.role == "dispatcher":
        server = _data_service.start_dispatcher(args.port, work_dir=args.work_dir)
        address = server.target[len("grpc://"):].replace("localhost", "127.0.0.1")
        print(f"kpipe data-service: dispatcher ready at {address}", flush=True)
    else:
        from kpipe.distribute._ports import free_ports

        port = args.port or free_ports(1, args.host)[0]
        server = _data_service.start_worker(args.dispatcher, port, host=args.host)
        print(f"kpipe data-service: worker ready at {args.host}:{port}, serving "
              f"dispatcher {args.dispatcher}", flush=True)
    return server


def _wait_for_stop(duration) -> None:
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        stop.wait(duration)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
