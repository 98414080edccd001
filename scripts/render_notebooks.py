"""Renders the notebooks into the docs site, from their executed outputs.

    python scripts/render_notebooks.py            # executes notebooks/*.ipynb, writes docs/notebooks/

Executes every notebook top to bottom in a real `python3` Jupyter kernel (as
tests/test_notebooks.py does, `KPIPE_SMALL=1` sizes, in an empty folder), then writes one
Markdown page per notebook: its Markdown cells as they are, each code cell as an
```` ```py ```` block (executed here and by tests/test_notebooks.py, so the docs'
python-block runner leaves them alone), and the cell's outputs below it -- printed text,
results, and images saved as PNG files next to the page. The notebooks stay committed
without outputs; the pages and images are committed, with the machine that ran them.
`tests/test_docs.py` checks that each page's code blocks are its notebook's code cells, so
a notebook edited without re-rendering fails the suite.

`--only 01` renders the notebooks whose name starts with 01.
"""

import argparse
import base64
import glob
import os
import platform
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "notebooks")
_MAX_TEXT_LINES = 40
# TensorFlow's start-up log on the kernel's stderr (absl, oneDNN, CUDA probing): not the notebook's output
_LOG_NOISE = re.compile(r"^([IWE]\d{4} \d+:\d+:[\d.]+ +\d+ \S+:\d+\] |WARNING: All log messages before absl)")


def _text(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.get("data", {}).get("text/plain", "")
    if output.output_type == "error":
        return "\n".join(output.traceback)
    return ""


def _clip(text):
    lines = [line for line in text.rstrip("\n").split("\n")
             if "\r" not in line and not _LOG_NOISE.match(line)]  # (progress bars, TF's log)
    while lines and not lines[0].strip():
        lines.pop(0)
    if len(lines) > _MAX_TEXT_LINES:
        lines = lines[: _MAX_TEXT_LINES // 2] + [f"... ({len(lines) - _MAX_TEXT_LINES} lines left out)"] + lines[-_MAX_TEXT_LINES // 2:]
    return "\n".join(lines)


def page(nb, name, machine):
    """The Markdown of an executed notebook, and {file name: PNG bytes} of its images."""
    parts, images = [], {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            parts.append(cell.source.strip())
            if index == 0:
                parts.append(f"*Rendered from `notebooks/{name}.ipynb`, executed by "
                             f"`scripts/render_notebooks.py` with `KPIPE_SMALL=1` on {machine}.*")
        elif cell.cell_type == "code":
            parts.append("```py\n" + cell.source.rstrip() + "\n```")
            text = "\n".join(t for t in (_text(o) for o in cell.outputs) if t.strip())
            if _clip(text).strip():
                parts.append("```text\n" + _clip(text) + "\n```")
            for output in cell.outputs:
                png = output.get("data", {}).get("image/png") if output.output_type != "stream" else None
                if png:
                    file = f"{name}_{len(images) + 1}.png"
                    images[file] = base64.b64decode(png)
                    parts.append(f"![output of cell {index + 1}]({file})")
    if not parts[0].startswith("# "):
        parts.insert(0, f"# {name}")
    return "\n\n".join(parts) + "\n", images


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="render only the notebooks whose name starts with this")
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, {platform.machine()}",
                        help="the machine, for each page's note")
    args = parser.parse_args(argv)
    import nbformat
    from nbclient import NotebookClient

    os.environ.update(KPIPE_SMALL="1", TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg",
                      PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                      PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    os.makedirs(OUT, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", f"{args.only}*.ipynb"))):
        name = os.path.splitext(os.path.basename(path))[0]
        nb = nbformat.read(path, as_version=4)
        with tempfile.TemporaryDirectory(prefix="kpipe-notebook-") as folder:
            NotebookClient(nb, kernel_name="python3", timeout=600, startup_timeout=180,
                           resources={"metadata": {"path": folder}}).execute()
        text, images = page(nb, name, args.machine)
        for old in glob.glob(os.path.join(OUT, f"{name}_*.png")):
            os.remove(old)
        for file, data in images.items():
            with open(os.path.join(OUT, file), "wb") as f:
                f.write(data)
        with open(os.path.join(OUT, f"{name}.md"), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"docs/notebooks/{name}.md: {sum(c.cell_type == 'code' for c in nb.cells)} code cells, "
              f"{len(images)} image(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
