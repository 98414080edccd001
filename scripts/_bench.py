"""What the benchmark scripts share: their option lists parsed, their tables printed.

Each parser reports a bad value through `parser.error` (exit status 2), saying what the
option takes and what it received.
"""


def parse_names(parser, option, value, allowed, allow_empty=False):
    """Parses a comma-separated subset of `allowed` names, as `--workloads a,b` gives.

    Args:
        parser: the script's `argparse.ArgumentParser`, whose `error` reports a bad value.
        option: the option's name as typed, e.g. "--workloads" (for the message).
        value: the option's string. Blanks around names and empty items are dropped.
        allowed: the names the option takes, in the order the message lists them.
        allow_empty: whether no name at all is accepted (an empty list).

    Returns:
        The names, in the order given.
    """
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not (names or allow_empty):
        parser.error(f"{option} takes a comma-separated subset of {', '.join(allowed)}"
                     f"{'' if allow_empty else ' (at least one)'}. Received: {_shown(value)}"
                     + (f" (unknown: {','.join(unknown)})" if 0 < len(unknown) < len(names) else ""))
    return names


def parse_counts(parser, option, value):
    """Parses comma-separated worker counts (integers >= 1), as `--counts 1,2,4` gives.

    Args:
        parser: the script's `argparse.ArgumentParser`, whose `error` reports a bad value.
        option: the option's name as typed, e.g. "--counts" (for the message).
        value: the option's string.

    Returns:
        The integers, in the order given (repeats kept).
    """
    try:
        counts = [int(item) for item in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        parser.error(f"{option} takes comma-separated worker counts >= 1. Received: {_shown(value)}")
    return counts


def parse_epochs(parser, option, value, workloads, default=1):
    """Parses epochs per workload: one number for every workload, or `w=N,...`.

    Args:
        parser: the script's `argparse.ArgumentParser`, whose `error` reports a bad value.
        option: the option's name as typed, e.g. "--epochs" (for the message).
        value: the option's string: "N", or "w=N,..." where a workload left out gets
            `default` and a name not in `workloads` is ignored.
        workloads: the script's workload names.
        default: the epochs of a workload that `w=N,...` leaves out.

    Returns:
        A dict from every name of `workloads`, in their order, to its epochs.
    """
    try:
        if "=" not in value:
            epochs = dict.fromkeys(workloads, int(value))
        else:
            given = {}
            for item in value.split(","):
                name, n = item.split("=")
                given[name.strip()] = int(n)
            epochs = {w: given.get(w, default) for w in workloads}
    except ValueError:
        epochs = {}
    if not epochs or min(epochs.values()) < 0:
        parser.error(f"{option} takes a number of epochs (>= 0) for every workload, or `w=N,...` per workload "
                     f"(w in {', '.join(workloads)}; {default} for those left out). Received: {value}")
    return epochs


def print_table(columns, rows, rule=True):
    """Prints a fixed-width table: a header line, a rule of "-" as wide, a line per row.

    Args:
        columns: one `(title, width, fmt)` per column: `width` is an alignment and width
            as in a format spec ("<10" left-aligned, ">12" right-aligned; "" for a last,
            free column), `fmt` the rest of the value's format spec (".1f", or "").
        rows: one sequence of values per row, a value per column; None prints "-".
        rule: whether a rule follows the header.
    """
    head = "".join(format(title, width) for title, width, _ in columns)
    print(head)
    if rule:
        print("-" * len(head))
    for row in rows:
        print("".join(format("-" if value is None else format(value, fmt), width)
                      for (_, width, fmt), value in zip(columns, row)))


def _shown(value):
    """`value` as a message shows it: quoted where it holds no name or number at all."""
    return value if value.strip(" ,") else repr(value)
