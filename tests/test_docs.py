"""The documentation site (docs/, mkdocs.yml) against the code it documents.

* Every public name (`kpipe.__all__`, `kpipe.data.__all__`, `kpipe.distribute.__all__`,
  `kpipe.callbacks.__all__`) has an entry in the API reference (`::: module.Name` on a page
  under docs/reference/) and a docstring with a runnable `Example:` (doctests).
* Every error and warning kpipe exports has its row in the troubleshooting guide.
* Every page is in the nav, every nav entry exists; the CLI page lists every subcommand
  and flag of the parsers.
* Every fenced ```python block of every page runs: a page's blocks in order, as one script
  in a fresh interpreter (logical devices, strategies) in an empty directory, small data.
  A block preceded by `<!-- docs-test: skip REASON -->` is reported as a skip with its reason.
* The site builds in strict mode (when MkDocs is installed: `pip install -e ".[docs]"`).
* The benchmark figures are drawn by scripts/plot_benchmarks.py from the committed JSON.
"""

import inspect
import os
import re
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\s+(.*?)\s*-->")


def _pages():
    out = []
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_") and d != "bench")
        out += [os.path.relpath(os.path.join(folder, f), DOCS) for f in sorted(files) if f.endswith(".md")]
    return sorted(out)


def _read(rel):
    with open(os.path.join(DOCS, rel), encoding="utf-8") as f:
        return f.read()


def python_blocks(text):
    """[(first line number, code, skip reason or None)] of the page's ```python fences."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            before = next((lines[k] for k in range(start - 2, -1, -1) if lines[k].strip()), "")
            skip = SKIP_MARK.search(before)
            blocks.append((start + 1, "\n".join(body), skip.group(1) if skip else None))
        i += 1
    return blocks


def _public():
    import kpipe

    modules = [kpipe, kpipe.data, kpipe.distribute, kpipe.callbacks]
    return [(m.__name__, name, getattr(m, name)) for m in modules for name in m.__all__]


def _reference_entries():
    entries = {}
    for rel in _pages():
        if rel.startswith("reference" + os.sep):
            for ident in re.findall(r"^::: ([\w.]+)\s*$", _read(rel), flags=re.M):
                entries[ident] = rel
    return entries


def test_the_python_block_reader_sees_fences_and_skip_marks():
    text = "x\n```python\na = 1\n```\n<!-- docs-test: skip needs Ray -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "a = 1", None), (7, "b = 2", "needs Ray")]


def has_example(doc):
    """Whether a docstring has an `Example:` section (`Example (where it runs):` too) with code:
    a doctest (run by --doctest-modules), an indented block or a fence."""
    match = re.search(r"^Examples?\b[^\n]*:\s*$", doc, flags=re.M)
    if not match:
        return False
    body = doc[match.end():]
    return bool(re.search(r"^\s*>>> |^ {4}\S|^```", body, flags=re.M))


def test_has_example_wants_a_section_with_code():
    assert has_example("Does x.\n\nExample:\n\n>>> f()\n1\n")
    assert has_example("Does x.\n\nExample (needs Ray):\n\n    f(ray=True)\n")
    assert not has_example("Does x.\n\nExample:\n\nCall f.\n")
    assert not has_example("Does x, for example f().\n")


def test_every_public_name_has_a_reference_entry_and_a_docstring_example():
    entries = _reference_entries()
    missing_page, missing_example = [], []
    for module, name, obj in _public():
        ident = obj.__name__ if isinstance(obj, types.ModuleType) else f"{obj.__module__}.{obj.__qualname__}"
        if ident not in entries:
            missing_page.append(f"{module}.{name} (add `::: {ident}` to a page under docs/reference/)")
        if not has_example(inspect.getdoc(obj) or ""):
            missing_example.append(f"{module}.{name}")
    assert not missing_page, f"public names without an API reference entry: {missing_page}"
    assert not missing_example, f"public names whose docstring has no `Example:` with code: {missing_example}"
    assert len(entries) >= len(_public()) - 1  # (kpipe.data etc. counted once as modules)


def test_every_reference_entry_names_an_importable_object():
    import importlib

    for ident, page in _reference_entries().items():
        module, _, attr = ident.rpartition(".")
        try:
            obj = importlib.import_module(ident)
        except ImportError:
            obj = getattr(importlib.import_module(module), attr, None)
        assert obj is not None, f"{page}: `::: {ident}` names nothing"


def test_troubleshooting_names_every_error_and_warning():
    text = _read(os.path.join("guides", "troubleshooting.md"))
    errors = [f"{m}.{n}" for m, n, o in _public() if isinstance(o, type) and issubclass(o, (Exception, Warning))]
    assert len(errors) >= 10
    missing = [e for e in errors if f"`{e}`" not in text]
    assert not missing, f"docs/guides/troubleshooting.md has no row for {missing}"


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    nav = config[config.index("\nnav:"):]
    listed = re.findall(r":\s+([\w./-]+\.md)\s*$", nav, flags=re.M)
    assert sorted(listed) == sorted(set(listed)), "a page is listed twice"
    assert sorted(listed) == sorted(p.replace(os.sep, "/") for p in _pages())


def test_cli_reference_lists_every_subcommand_and_flag():
    sys.path.insert(0, os.path.join(DOCS, "_hooks"))
    try:
        import cli_reference
    finally:
        sys.path.pop(0)
    from kpipe import cli

    assert cli_reference.MARKER in _read(os.path.join("reference", "cli.md"))
    text = cli_reference.render()
    for name in cli._SUBCOMMANDS:
        assert f"## `kpipe {name}`" in text
        parser = cli_reference._subparsers(cli._build_parser(name))[name]
        parsers = [parser, *cli_reference._subparsers(parser).values()]
        for p in parsers:
            for action in p._actions:
                for option in ([] if action.help == "show this help message and exit" else action.option_strings):
                    assert f"`{option}" in text, (name, option)
    assert "`kpipe data-service dispatcher`" in text and "`kpipe data-service worker`" in text


def test_docstring_examples_render_as_code():
    sys.path.insert(0, os.path.join(DOCS, "_hooks"))
    try:
        griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extra: pip install -e \".[docs]\"")
        from doctest_fences import fence_doctests
    finally:
        sys.path.pop(0)
    assert griffe
    text = "Example:\n\n>>> x = [1]\n>>> x\n[1]\n\nMore.\n\n    >>> y = 2\n"
    assert fence_doctests(text) == ("Example:\n\n```pycon\n>>> x = [1]\n>>> x\n[1]\n```\n\nMore.\n\n"
                                    "    ```pycon\n    >>> y = 2\n    ```\n")
    assert fence_doctests("```python\n>>> z\n```\n") == "```python\n>>> z\n```\n"  # fenced already


# -- every code block runs ---------------------------------------------------------------

def _page_params():
    params = []
    for rel in _pages():
        text = _read(rel)
        blocks = python_blocks(text)
        if not any(skip is None for _, _, skip in blocks):
            continue
        marks = [pytest.mark.timeout(420)]
        if "ProcessLoader" in text or "launch(" in text or "py_map_fn" in text:
            marks.append(pytest.mark.multiprocess)
        if ".fit(" in text or "launch(" in text or "fit_generator" in text or "ps_fit" in text:
            marks.append(pytest.mark.slow)
        if "distribute.launch(" in text:
            marks.append(pytest.mark.multiworker)
        if "RayWorkers(" in text:
            marks.append(pytest.mark.ray)
        params.append(pytest.param(rel, marks=marks, id=rel.replace(os.sep, "/")))
    return params


def _skipped_params():
    return [pytest.param(rel, line, reason, id=f"{rel.replace(os.sep, '/')}:{line}")
            for rel in _pages() for line, _, reason in python_blocks(_read(rel)) if reason]


@pytest.mark.parametrize("page", _page_params())
def test_the_python_blocks_of_a_page_run(page, tmp_path):
    if "RayWorkers(" in _read(page):
        pytest.importorskip("ray", reason="the page starts Ray actors: pip install -e \".[ray]\"")
    parts = []
    for line, code, skip in python_blocks(_read(page)):
        if skip is None:
            parts.append(f"# --- docs/{page}, block at line {line}\n{code}\n")
    script = tmp_path / "page.py"
    script.write_text("\n".join(parts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               TF_CPP_MIN_LOG_LEVEL="2", KPIPE_SMALL="1", MPLBACKEND="Agg", PATH=os.path.dirname(sys.executable)
               + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"docs/{page}: its python blocks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page,line,reason", _skipped_params())
def test_a_block_marked_skip_says_why(page, line, reason):
    assert len(reason) > 20, f"docs/{page}:{line}: say why the block is not run"
    pytest.skip(f"docs/{page}:{line} not run: {reason}")


# -- the site and its figures ------------------------------------------------------------

def _docs_tools_missing():
    import importlib.util

    return [m for m in ("mkdocs", "material", "mkdocstrings_handlers") if importlib.util.find_spec(m) is None]


@pytest.mark.timeout(300)
def test_the_site_builds_in_strict_mode(tmp_path):
    missing = _docs_tools_missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed in this interpreter; "
                    "`pip install -e \".[docs]\"` to build the site (CI does)")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_docs.py"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for page in ("index.html", "guides/drop-in-loader.html", "reference/kpipe.html", "reference/cli.html",
                 "search/search_index.json"):
        assert (site / page).exists(), page
    reference = (site / "reference" / "kpipe.html").read_text()
    assert "ProcessLoader" in reference and "max_queue_bytes" in reference
    assert "--max-queue-size" not in reference  # (no CLI text leaks into the API pages)
    assert "kpipe launch" in (site / "reference" / "cli.html").read_text()
    assert "ProcessLoader" in (site / "search" / "search_index.json").read_text()


def test_the_benchmark_figures_are_drawn_from_the_committed_json(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib: pip install -e \".[plot]\"")
    bench = os.path.join(DOCS, "bench")
    jsons = {"loaders": ["loaders.json", "loaders_w4.json"], "feed": ["feed.json"], "ray": ["ray.json"]}
    argv = ["--out-dir", str(tmp_path)]
    for flag, files in jsons.items():
        present = [os.path.join(bench, f) for f in files if os.path.exists(os.path.join(bench, f))]
        if present:
            argv += [f"--{flag}", *present]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_benchmarks.py"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = _read("benchmarks.md")
    with open(os.path.join(bench, "README.md"), encoding="utf-8") as f:
        made_by = f.read()
    for png in re.findall(r"\(bench/(\w+\.png)\)", page):
        assert (tmp_path / png).stat().st_size > 10_000, png
        assert os.path.exists(os.path.join(bench, png)), f"docs/bench/{png} is not committed"
    for name in os.listdir(bench):
        if name.endswith(".json"):
            assert name in made_by, f"docs/bench/README.md does not say which command made {name}"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_site_renders_in_a_headless_browser_and_search_finds_processloader(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import check_docs_browser
    finally:
        sys.path.pop(0)
    missing = _docs_tools_missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed in this interpreter: the site cannot be built here")
    if not check_docs_browser.find_browser():
        pytest.skip("no Chromium on this machine (apt-get install chromium): the browser check cannot run")
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_docs.py"), "--site-dir", str(site)],
                           capture_output=True, text=True, timeout=280)
    assert build.returncode == 0, build.stderr[-3000:]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_docs_browser.py"), str(site)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok  ") == 7 and "FAIL" not in proc.stdout


def test_the_compatibility_page_has_the_readme_tested_with_rows():
    # the README's table is the one scripts/version_matrix.py and tests/test_compat.py keep;
    # until it moves here (README cut to a front page), the copy must not drift from it
    def rows(text):
        return [line for line in text.splitlines() if re.match(r"\|\s*\d+\.\d+", line)]

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("<!-- BEGIN tested-with", 1)[1].split("<!-- END tested-with", 1)[0]
    assert rows(section) and rows(_read("compatibility.md")) == rows(section)


def test_the_rendered_notebooks_show_each_notebook_code_as_it_is():
    # docs/notebooks/ is written by scripts/render_notebooks.py from executed notebooks; a
    # notebook edited without re-rendering its page fails here (tests/test_notebooks.py runs them)
    import glob

    nbformat = pytest.importorskip("nbformat")
    notebooks = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    assert notebooks
    for path in notebooks:
        name = os.path.splitext(os.path.basename(path))[0]
        rendered = _read(os.path.join("notebooks", f"{name}.md"))
        blocks = re.findall(r"^```py\n(.*?)\n```$", rendered, flags=re.S | re.M)
        cells = [c.source.rstrip() for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert blocks == cells, f"docs/notebooks/{name}.md is out of date: python scripts/render_notebooks.py --only {name[:2]}"
        assert "KPIPE_SMALL=1" in rendered
        for image in re.findall(r"\]\(([\w.-]+\.png)\)", rendered):
            assert os.path.exists(os.path.join(DOCS, "notebooks", image)), image


def test_code_fences_are_python_that_runs_or_marked_as_other_languages():
    # ```py is kept for the rendered notebooks' cells (run by tests/test_notebooks.py); a page
    # elsewhere that wrote ```py or ```python3 would slip past the block runner
    for rel in _pages():
        if rel.startswith("notebooks" + os.sep):
            continue
        for fence in re.findall(r"^\s*```(\w+)", _read(rel), flags=re.M):
            assert fence not in ("py", "python3", "ipython", "py3"), f"docs/{rel}: use ```python (it runs) for {fence}"


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_render_notebooks_writes_cells_outputs_and_images_without_tensorflow_noise():
    nbformat = pytest.importorskip("nbformat")
    render = _script("render_notebooks")
    png = b"\x89PNG\r\n\x1a\nfake"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Title\n\nIntro."),
        nbformat.v4.new_code_cell("x = 1\n\n\nprint(x)", outputs=[
            nbformat.v4.new_output("stream", name="stderr",
                                   text="I0000 00:00:1796599582.246087   26796 port.cc:153] oneDNN custom operations\n"),
            nbformat.v4.new_output("stream", name="stdout", text="1\n")]),
        nbformat.v4.new_code_cell("figure", outputs=[nbformat.v4.new_output(
            "display_data", data={"image/png": __import__("base64").b64encode(png).decode(), "text/plain": "<Figure>"})]),
    ])
    text, images = render.page(nb, "01_demo", "a test machine")
    assert text.startswith("# Title\n\nIntro.\n\n*Rendered from `notebooks/01_demo.ipynb`")
    assert "```py\nx = 1\n\n\nprint(x)\n```\n\n```text\n1\n```" in text and "oneDNN" not in text
    assert images == {"01_demo_1.png": png} and "![output of cell 3](01_demo_1.png)" in text


def test_the_browser_check_finds_links_that_do_not_resolve(tmp_path):
    check = _script("check_docs_browser")
    (tmp_path / "guides").mkdir()
    (tmp_path / "index.html").write_text('<h1 id="top">x</h1>')
    page = ('<a href="../index.html#top">ok</a><a href="../index.html#gone">bad anchor</a>'
            '<a href="missing.html">bad file</a><a href="https://example.org/">external</a><a href="#here">self</a>'
            '<span id="here"></span>')
    (tmp_path / "guides" / "a.html").write_text(page)
    assert check.check_links(str(tmp_path), "guides/a.html", page) == [
        ("../index.html#gone", "no such anchor"), ("missing.html", "no such file")]


def test_the_readme_is_a_front_page_of_at_most_200_lines_whose_links_resolve():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200, "the README is the front page: move detail to a docs/ page"
    targets = [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme) if "://" not in m.group(1)]
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README links to files that do not exist: {missing}"
