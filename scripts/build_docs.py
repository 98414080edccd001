"""Builds the documentation site from `docs/` with MkDocs, in strict mode.

    pip install -e ".[docs]"          # MkDocs, Material, mkdocstrings[python], the pins CI uses
    python scripts/build_docs.py       # -> build/site/index.html; a warning fails the build
    python scripts/build_docs.py --serve   # live preview on http://127.0.0.1:8000

Strict mode (`mkdocs.yml` sets `strict: true`, and this passes `--strict` too) turns every
warning into a failure: a broken link or anchor, an API reference entry (`::: name`) that
does not resolve, a page missing from the nav. The API reference is read from the
docstrings by griffe without importing kpipe; the command-line page is generated from
kpipe's argparse parsers (`docs/_hooks/cli_reference.py`), which imports `kpipe.cli`
(no TensorFlow). Exits with mkdocs's status.
"""

import argparse
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="serve a live preview instead of building")
    parser.add_argument("--site-dir", default=None, help="where the site goes. Defaults to mkdocs.yml's (build/site/)")
    args = parser.parse_args(argv)
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if _missing(m)]
    if missing:
        print(f"build_docs.py: {', '.join(missing)} not installed; install the docs extra: "
              f"pip install -e \".[docs]\"", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "mkdocs", "serve" if args.serve else "build", "--strict",
               "--config-file", os.path.join(ROOT, "mkdocs.yml")]
    if args.site_dir and not args.serve:
        command += ["--site-dir", os.path.abspath(args.site_dir)]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.call(command, cwd=ROOT, env=env)


def _missing(module):
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


if __name__ == "__main__":
    sys.exit(main())
