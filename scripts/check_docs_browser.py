"""Opens the built documentation site in a real headless Chromium, as a reader would.

    python scripts/build_docs.py --site-dir build/site
    python scripts/check_docs_browser.py build/site        # needs chromium (apt-get install chromium)

Serves the site on 127.0.0.1 (a free port; Material's search runs in a web worker, which
Chromium does not start from file:// pages), then with `chromium --headless --dump-dom`
(the DOM after the page's scripts ran):

* the home page, one guide and one API reference page render: each has its title and the
  text it should show, and the theme's navigation;
* every link on those pages resolves: a relative href names a file of the site, and its
  `#anchor` an element id on that page;
* search finds `ProcessLoader`: typed into the home page's search box (Chromium driven over
  the DevTools protocol), it lists a result on the API reference page.

Prints one line per check and exits 1 if any fails, 2 if no Chromium is found.
"""

import argparse
import contextlib
import functools
import html.parser
import http.server
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

PAGES = [  # (path, text the rendered page must show)
    ("index.html", "Keep the accelerator busy"),
    ("guides/drop-in-loader.html", "Drop-in loader for a"),
    ("reference/kpipe.html", "max_queue_bytes"),
]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def _parse(text):
    parser = _Links()
    parser.feed(text)
    return parser


def find_browser():
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


@contextlib.contextmanager
def _profile():
    """A fresh Chromium profile folder, removed afterwards. Chromium's helper processes (crashpad,
    utility) may still write into it for a moment after the browser exits: the removal retries for
    10 s before it gives up with the error."""
    profile = tempfile.mkdtemp(prefix="kpipe-docs-chromium-")
    try:
        yield profile
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                shutil.rmtree(profile)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _stop(proc):
    """Ends the browser and every process it started (it runs in a session of its own)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # helpers that outlived the browser


def dump_dom(browser, url, timeout_s=90):
    """The page's DOM after its scripts ran (virtual time lets timers and the worker finish)."""
    with _profile() as profile:
        proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--dump-dom", url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            dom, err = proc.communicate(timeout=timeout_s)
        finally:
            _stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{browser} exited {proc.returncode} on {url}: {err[-1500:]}")
    return dom


_SEARCH_JS = """
new Promise((resolve) => {
  const box = document.querySelector("input.md-search__input");
  box.focus();
  box.value = %s;
  for (const type of ["focus", "input", "keyup"]) box.dispatchEvent(new Event(type, {bubbles: true}));
  const started = Date.now();
  (function poll() {
    const links = [...document.querySelectorAll(".md-search-result__list a")].map((a) => a.getAttribute("href"));
    if (links.length || Date.now() - started > 20000) resolve(JSON.stringify(links)); else setTimeout(poll, 200);
  })();
})
"""


def search(browser, url, query, timeout_s=90):
    """The result links Material's search lists after typing `query` on `url`: Chromium driven
    over the DevTools protocol (tornado's websocket client; it comes with Jupyter)."""
    import asyncio
    import json
    import re
    import urllib.request

    from tornado.websocket import websocket_connect

    async def drive(ws_url):
        ws = await websocket_connect(ws_url, max_message_size=64 << 20)
        ids = iter(range(1, 1 << 30))

        async def call(method, **params):
            mine = next(ids)
            ws.write_message(json.dumps({"id": mine, "method": method, "params": params}))
            while True:
                message = json.loads(await ws.read_message())
                if message.get("id") == mine:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message["result"]
                if message.get("method") == "Page.loadEventFired":
                    loaded.set()

        loaded = asyncio.Event()
        await call("Page.enable")
        await call("Page.navigate", url=url)
        while not loaded.is_set():  # events arrive between replies; wait for the load event
            message = json.loads(await ws.read_message())
            if message.get("method") == "Page.loadEventFired":
                loaded.set()
        result = await call("Runtime.evaluate", expression=_SEARCH_JS % json.dumps(query), awaitPromise=True,
                            returnByValue=True)
        ws.close()
        return json.loads(result["result"]["value"])

    with _profile() as profile:
        proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                 f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            port = None
            for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
                match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
                if match:
                    port = int(match.group(1))
                    break
            if port is None:
                raise RuntimeError(f"{browser} did not open its DevTools port")
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # (a full pipe would stall it)
            request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
            with urllib.request.urlopen(request, timeout=30) as response:
                target = json.loads(response.read())
            return asyncio.run(asyncio.wait_for(drive(target["webSocketDebuggerUrl"]), timeout_s))
        finally:
            _stop(proc)


def _serve(site):
    handler = functools.partial(_QuietHandler, directory=site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def check_links(site, page, dom):
    """Relative links of a rendered page that do not resolve: [(href, why)]."""
    bad, cache = [], {}
    for href in _parse(dom).hrefs:
        url = urllib.parse.urlsplit(href)
        if url.scheme or url.netloc or href.startswith(("mailto:", "javascript:")):
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(page), urllib.parse.unquote(url.path))) if url.path else page
        path = os.path.join(site, target)
        if os.path.isdir(path):
            path = os.path.join(path, "index.html")
        if not os.path.exists(path):
            bad.append((href, "no such file"))
            continue
        if url.fragment and path.endswith(".html"):
            if path not in cache:
                with open(path, encoding="utf-8") as f:
                    cache[path] = _parse(f.read()).ids
            if urllib.parse.unquote(url.fragment) not in cache[path]:
                bad.append((href, "no such anchor"))
    return bad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="build/site", help="the built site. Defaults to build/site")
    args = parser.parse_args(argv)
    browser = find_browser()
    if not browser:
        print(f"check_docs_browser.py: no Chromium found (looked for {', '.join(BROWSERS)}); "
              "install one, e.g. apt-get install chromium", file=sys.stderr)
        return 2
    site = os.path.abspath(args.site)
    server = _serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    failures = 0
    try:
        for page, text in PAGES:
            dom = dump_dom(browser, base + page)
            rendered = text in dom and 'class="md-nav' in dom and "md-content" in dom
            links = _parse(dom).hrefs
            bad = check_links(site, page, dom)
            print(f"{'ok  ' if rendered else 'FAIL'} {page} renders ({len(dom):,} bytes of DOM, shows {text!r})")
            print(f"{'ok  ' if not bad else 'FAIL'} {page}: {len(links)} links, {len(bad)} that do not resolve {bad[:5]}")
            failures += (not rendered) + bool(bad)
        results = search(browser, base + "index.html", "ProcessLoader")
        on_reference = [h for h in results if "reference/kpipe.html" in h]
        found = bool(on_reference)
        print(f"{'ok  ' if found else 'FAIL'} typing 'ProcessLoader' into the search box lists {len(results)} "
              f"result(s), {len(on_reference)} on reference/kpipe.html {on_reference[:3]}")
        failures += not found
    finally:
        server.shutdown()
        server.server_close()
    print(f"{browser}: {'all checks passed' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
