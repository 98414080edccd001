"""Turning the `paths`/`files` arguments of sources into a checked list of files."""

import glob
import os
from typing import List


def expand_paths(paths, arg: str, kind: str) -> List[str]:
    """Returns the files named by `paths`: one path, a glob pattern, or a list of them.

    Args:
        paths: A path (str or `os.PathLike`), a glob pattern such as `"data/*.h5"`, or a
            list/tuple of them.
        arg: The argument's name, for error messages.
        kind: What the files are, e.g. "HDF5", for error messages.

    Returns:
        The files, in the order given; each pattern's matches sorted.

    Raises:
        FileNotFoundError: if a path does not exist or a pattern matches nothing.
        TypeError: if `paths` is not a path or a list of paths.
        ValueError: if the list is empty or names a directory.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    elif not isinstance(paths, (list, tuple)):
        raise TypeError(
            f"`{arg}` must be a path, a glob pattern, or a list of them. Received: {arg}={paths!r} "
            f"of type {type(paths).__name__}."
        )
    out: List[str] = []
    for p in paths:
        if not isinstance(p, (str, bytes, os.PathLike)):
            raise TypeError(f"`{arg}` must contain paths. Received an item {p!r} of type {type(p).__name__}.")
        p = os.fsdecode(p)
        if glob.has_magic(p) and not os.path.exists(p):
            matches = sorted(glob.glob(p))
            if not matches:
                raise FileNotFoundError(f"`{arg}` pattern {p!r} matches no files. Check the path and pattern.")
            out.extend(matches)
            continue
        if not os.path.exists(p):
            raise FileNotFoundError(f"{kind} file {p!r} (from `{arg}`) does not exist. Check the path.")
        out.append(p)
    if not out:
        raise ValueError(f"`{arg}` is empty. Pass at least one {kind} file.")
    for p in out:
        if os.path.isdir(p):
            raise ValueError(f"`{arg}` names a directory, {p!r}; pass {kind} files (a glob such as {os.path.join(p, '*')!r} works).")
    return out
