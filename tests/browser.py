"""The built documentation site as headless Chromium lays it out: what a reader sees, measured in the page.

The site is served over HTTP on a free loopback port; one Chromium run loads a probe page that
opens each page to check in an iframe of a given width, measures it once it has loaded, and
writes the measurements into itself, which ``--dump-dom`` prints. No DevTools client is needed.
"""

from __future__ import annotations

import contextlib
import functools
import html
import http.server
import json
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

#: Debian's package installs it as chromium; other systems as one of the others.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: A browser that runs as root in a container, fetches nothing of its own, and keeps no state.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars",
         # Nothing but the site: Material's web fonts (Google Fonts) fail at once instead of waiting on DNS.
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")

#: What is measured in each page (a frame's document), as JSON.
MEASURE = r"""
function measure(doc) {
  const article = doc.querySelector("article") || doc.body;
  const lines = el => new Set([...el.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top))).size;
  // The names of a table of names (<div class="names">), and the settings table's defaults.
  const names = [...article.querySelectorAll(".names td:first-child code, .settings td:nth-child(3) code")]
                .filter(c => !/\s/.test(c.textContent.trim()));
  const blocks = [...article.querySelectorAll("pre > code")];
  return {
    names: names.length,
    // Laid out over more than one line: with no space in it, it broke mid-word.
    broken_names: names.filter(c => lines(c) > 1).map(c => c.textContent),
    blocks: blocks.length,
    // A code block whose text is wider than its box: the rest is out of sight, behind a scrollbar at best.
    hidden_blocks: blocks.filter(c => c.scrollWidth > c.clientWidth + 1)
                   .map(c => c.textContent.split("\n").find(l => l.length > 0) || ""),
  };
}
"""

PROBE = """<!doctype html>
<html><head><meta charset="utf-8"><title>probe</title></head><body>
{frames}
<pre id="measured"></pre>
<script>
{measure}
window.addEventListener("load", () => {{
  const out = {{}};
  for (const frame of document.querySelectorAll("iframe")) {{
    out[frame.dataset.name] = measure(frame.contentDocument);
  }}
  document.getElementById("measured").textContent = JSON.stringify(out);
}});
</script>
</body></html>
"""


def browser() -> Optional[str]:
    """The Chromium on the PATH, or None."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


class _Site(http.server.SimpleHTTPRequestHandler):
    probe = b""

    def do_GET(self) -> None:
        if self.path.startswith(("/search/", "/assets/javascripts/workers/")):
            # Each page's search worker would fetch and index the whole site: nothing measured needs it.
            self.send_error(404)
        elif self.path == "/__probe__.html":
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(self.probe)))
            self.end_headers()
            self.wfile.write(self.probe)
        else:
            super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _served(site: Path, probe: str) -> Iterator[str]:
    """The site's address while it is served, ``/__probe__.html`` being ``probe``."""
    handler = functools.partial(type("Site", (_Site,), {"probe": probe.encode()}), directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def measured(site: Path, pages: List[Tuple[str, str, int]], timeout: float = 60) -> Dict[str, Dict[str, Any]]:
    """Each page of ``site`` (name, path under the site, window width) laid out by Chromium, measured.

    >>> found = measured(Path("site"), [("settings", "reference/settings/", 1280)])  # doctest: +SKIP
    >>> found["settings"]["broken_names"], found["settings"]["hidden_blocks"]  # doctest: +SKIP
    ([], [])
    """
    path = browser()
    assert path is not None, "no Chromium: " + ", ".join(BROWSERS)
    frames = "\n".join(f'<iframe data-name="{html.escape(name)}" src="/{html.escape(page)}" '
                       f'style="width:{width}px;height:900px;border:0"></iframe>' for name, page, width in pages)
    with _served(site, PROBE.format(frames=frames, measure=MEASURE)) as url:
        with tempfile.TemporaryDirectory(prefix="celery-zklock-chromium-") as profile:
            out = subprocess.run([path, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", f"{url}/__probe__.html"],
                                 capture_output=True, text=True, timeout=timeout)
    m = re.search(r'<pre id="measured">(.*?)</pre>', out.stdout, re.DOTALL)
    assert m and m.group(1), f"Chromium printed no measurements (exit {out.returncode}):\n{out.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


def screenshot(site: Path, page: str, to: Path, width: int = 1280, height: int = 2400, timeout: float = 60) -> None:
    """A PNG of one page of ``site`` as Chromium draws it, to look at when a measurement fails."""
    path = browser()
    assert path is not None
    with _served(site, "") as url:
        with tempfile.TemporaryDirectory(prefix="celery-zklock-chromium-") as profile:
            subprocess.run([path, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                            f"--screenshot={to}", f"{url}/{page}"], capture_output=True, timeout=timeout)
