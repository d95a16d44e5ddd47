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
  const style = el => doc.defaultView.getComputedStyle(el);
  // The names of a table of names (<div class="names">), and the settings table's defaults.
  const names = [...article.querySelectorAll(".names td:first-child code, .settings td:nth-child(3) code")]
                .filter(c => !/\s/.test(c.textContent.trim()));
  // Where inline code laid out over lines breaks between two letters or digits ("maxSessi" / "onTimeout"),
  // as "maxSessi|onTimeout"; null if it breaks only between words (at a space, after a _ . / ::), or not at all.
  const word = /[A-Za-z0-9]/;
  const range = doc.createRange();
  const midWord = code => {
    const walker = doc.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    let text = "", before = null, top = null;
    for (let node; (node = walker.nextNode());) {
      for (let i = 0; i < node.data.length; i++) {
        const ch = node.data[i];
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const rect = [...range.getClientRects()].find(r => r.width > 0);
        if (rect && top !== null && rect.top > top + 2 && word.test(before) && word.test(ch)) {
          return text + "|" + code.textContent.slice(text.length);
        }
        text += ch;
        [before, top] = rect ? [ch, rect.top] : [ch, null];
      }
    }
    return null;
  };
  const inline = [...article.querySelectorAll("code")].filter(c => !c.closest("pre"));
  const right = article.getBoundingClientRect().right;
  const scrolls = el => ["auto", "scroll"].includes(style(el).overflowX) && style(el).scrollbarWidth !== "none";
  // Within something that scrolls to it (a wide table: Material wraps each in a box that scrolls).
  const scrolled = el => {
    for (el = el.parentElement; el && el !== article; el = el.parentElement) if (scrolls(el)) return true;
    return false;
  };
  // Inline code whose text runs past the page's text column, out of reach (its padding may stick out at a
  // line's end).
  const past = c => [...c.getClientRects()].some(r => r.right - parseFloat(style(c).paddingRight) > right + 1) &&
                    !scrolled(c);
  // A code block's lines as drawn: the distinct tops of its text's boxes (a wrapped line adds one).
  const drawn = code => {
    range.selectNodeContents(code);
    const tops = [...range.getClientRects()].filter(r => r.width > 0).map(r => r.top).sort((a, b) => a - b);
    return tops.filter((t, i) => i === 0 || t > tops[i - 1] + 2).length;
  };
  const blocks = [...article.querySelectorAll("pre > code")].map(code => ({
    first: code.textContent.split("\n").find(l => l.length > 0) || "",
    // Its text is wider than its box.
    wide: code.scrollWidth > code.clientWidth + 1,
    // And the box lets a reader scroll to the rest, with a scrollbar.
    scrolls: scrolls(code),
    // The box itself is within the page's text column (not cut off by the page's edge).
    inside: code.getBoundingClientRect().right <= right + 1,
    // Drawn over more lines than it has: a long line went on below.
    wrapped: drawn(code) > code.textContent.replace(/\n+$/, "").split("\n").filter(l => l.length > 0).length,
    // In a block marked as prose (<div class="wrap" markdown>), whose lines may wrap.
    prose: code.closest(".wrap") !== null,
  }));
  return {
    names: names.length,
    // Laid out over more than one line: with no space in it, it broke mid-word.
    broken_names: names.filter(c => lines(c) > 1).map(c => c.textContent),
    inline: inline.length,
    broken_inline: inline.filter(c => lines(c) > 1).map(midWord).filter(b => b !== null),
    hidden_inline: inline.filter(past).map(c => c.textContent),
    blocks: blocks,
    // Tables too wide for the page, which scroll: their header row.
    wide_tables: [...article.querySelectorAll("table")].filter(t => t.getBoundingClientRect().right > right + 1)
                 .map(t => t.rows[0].textContent.trim().replace(/\s+/g, " ")),
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
    >>> found["settings"]["broken_names"], found["settings"]["broken_inline"]  # doctest: +SKIP
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
