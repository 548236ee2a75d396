"""The browser check of scripts/check-site: serve SITE on 127.0.0.1, drive headless Chromium
at 1280 px, and check the site the way a newcomer meets it.

Usage: python scripts/check_site.py SITE_DIR SCREENSHOT_DIR. Every page reachable from the
home page is opened: none may log a console error, link to a missing page or anchor, show
code broken inside a word (in a table or in the text), or code running past the page's
edge. Then: the navigation's sections, a click
from the home page to the tutorial, a search for a variable, a copy button on every code
block, and the API pages headed with public names. Screenshots of the pages a newcomer
reads first go to SCREENSHOT_DIR. Exits 1 with every failure; prints what it saw.
"""

from __future__ import annotations

import functools
import http.server
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

WIDTH, HEIGHT = 1280, 900
# As root and on a machine without a network: no sandbox, and none of Chromium's own
# background connections (each would be refused, many at a time).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WIDTH},{HEIGHT}",
]
# The pages a newcomer reads first, and the widest tables: screenshot name -> path.
TOUR = {
    "home": "",
    "quickstart": "quickstart/",
    "webdataset": "guides/webdataset/",
    "configuration": "reference/configuration/",
    "cli": "reference/cli/",
    "api-datasets": "reference/api/datasets/",
    "errors": "reference/errors/",
    "benchmarks": "benchmarks/",
}
SECTIONS = ["Tutorial", "How-to guides", "Reference", "Explanation", "Development"]
FIRST_STEP = "Your first cached job"  # the tutorial page the home page's navigation opens
# Material's copy-to-clipboard button on a code block (9.7 and later; before).
COPY_BUTTON = "button[data-md-type=copy], button.md-clipboard"
VARIABLE = "SHARDCACHE_THREADS"  # searched for; the configuration page must be a result

# Inline code a reader would trip over: a code span broken inside a word (two characters
# next to each other, neither a space, on different lines), and outside a table (which
# scrolls) a code span running past the article's right edge.
CODE_JS = """
const broken = [], overflowing = [];
const range = document.createRange();
const edge = document.querySelector("article").getBoundingClientRect().right;
for (const code of document.querySelectorAll("article :not(pre) > code")) {
  const rects = code.getClientRects();
  const inTable = code.closest("table") !== null;
  if (!inTable && [...rects].some(r => r.right > edge + 1)) {
    overflowing.push(code.textContent.slice(0, 80));
  }
  if (rects.length < 2) continue;
  const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
  let top = null, prev = " ", node;
  outer: while ((node = walker.nextNode())) {
    for (let i = 0; i < node.length; i++) {
      const ch = node.data[i];
      range.setStart(node, i); range.setEnd(node, i + 1);
      const rect = range.getBoundingClientRect();
      if (rect.width === 0) { prev = ch; continue; }
      if (top !== null && rect.top > top + 2 && !/\\s/.test(prev) && !/\\s/.test(ch)) {
        broken.push((inTable ? "table: " : "") + code.textContent.slice(0, 80));
        break outer;
      }
      top = rect.top; prev = ch;
    }
  }
}
return {broken, overflowing};
"""
PAGE_FACTS_JS = """
const links = [...document.querySelectorAll("a[href]")].map(a => a.href);
const assets = [...document.querySelectorAll("link[href], script[src], img[src]")]
  .map(e => e.href || e.src);
const ids = [...document.querySelectorAll("[id]")].map(e => e.id);
// The names an API page shows: its entries' headings and its contents in the navigation.
const names = [...document.querySelectorAll(
  "article .doc-heading, nav.md-nav--primary .md-nav--secondary a.md-nav__link"
)].map(e => e.textContent.trim().split("\\n")[0]);
return {links, assets, ids, names};
"""


# Screenshots show pages at rest: no transition caught half-way (the header's title slides).
STILL_JS = """
const style = document.createElement("style");
style.textContent = "*, *::before, *::after { transition: none !important; }";
document.head.appendChild(style);
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A browser that drops a connection it no longer needs is not an error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def browser(profile: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_page_load_timeout(30)
    return driver


@functools.cache
def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


class Check:
    """One browser session over the site; ``failures`` collects what a newcomer would see."""

    def __init__(self, driver: webdriver.Chrome, base: str, out: Path) -> None:
        self.driver = driver
        self.base = base
        self.out = out
        self.wait = WebDriverWait(driver, 15)
        self.failures: list[str] = []
        self.ids: dict[str, set[str]] = {}  # page -> the ids an anchor can point at
        self.api_names: dict[str, list[str]] = {}  # API page -> its headings and contents

    def expect(self, ok: bool, failure: str) -> bool:
        if not ok and failure not in self.failures:
            self.failures.append(failure)
            print(f"FAIL {failure}")
        return ok

    def open(self, url: str) -> None:
        self.driver.get(url)
        # Material's own script wraps each table in a scrolling frame once the page is ready.
        self.wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        for entry in self.driver.get_log("browser"):
            if entry["level"] == "SEVERE":
                self.expect(False, f"{self.page(url)}: console error: {entry['message']}")

    def page(self, url: str) -> str:
        return "/" + urldefrag(url)[0].removeprefix(self.base)

    def crawl(self) -> None:
        """Open every page reachable from the home page; check each one's console, tables
        and assets; then every internal link's page and anchor."""
        todo, seen = [self.base], {self.base}
        links: dict[str, str] = {}  # an internal link or asset -> the first page using it
        while todo:
            url = todo.pop()
            self.open(url)
            code = self.driver.execute_script(CODE_JS)
            where = self.page(url)
            self.expect(not code["broken"], f"{where}: code broken mid-word: {code['broken']}")
            self.expect(
                not code["overflowing"], f"{where}: code past the edge: {code['overflowing']}"
            )
            facts = self.driver.execute_script(PAGE_FACTS_JS)
            self.ids[url] = set(facts["ids"])
            if "/reference/api/" in url:
                self.api_names[url] = facts["names"]
            for link in facts["links"] + facts["assets"]:
                if link.startswith(self.base):
                    links.setdefault(link, url)
            for link in facts["links"]:
                target = urldefrag(link)[0]
                if link.startswith(self.base) and target not in seen and _is_page(target):
                    seen.add(target)
                    if status(target) == 200:
                        todo.append(target)
        for link, page in sorted(links.items()):
            target, anchor = urldefrag(link)
            where = f"{self.page(page)} links to {self.page(target)}"
            code = status(target)
            if not self.expect(code == 200, f"{where}: HTTP {code}") or not anchor:
                continue
            if target in self.ids:
                self.expect(anchor in self.ids[target], f"{where}#{anchor}: no such anchor")
        print(f"crawl: {len(seen)} pages, {len(links)} internal links and assets")

    def tour(self) -> None:
        """Screenshots at 1280 px of the pages a newcomer reads first: the top of each page
        and, where it has one, its widest table."""
        for name, path in TOUR.items():
            self.open(self.base + path)
            self.driver.execute_script(STILL_JS)
            h1 = self.driver.find_element(By.CSS_SELECTOR, "article h1").text
            self.driver.save_screenshot(str(self.out / f"{name}.png"))
            shots = [f"{name}.png"]
            tables = self.driver.find_elements(By.CSS_SELECTOR, "article table")
            if tables:
                widest = max(tables, key=lambda t: t.size["width"] * 1000 + len(t.text))
                self.show(widest)
                self.driver.save_screenshot(str(self.out / f"{name}-table.png"))
                shots.append(f"{name}-table.png")
            print(f"{name}: {h1!r}, {len(tables)} tables; {', '.join(shots)}")

    def show(self, element: WebElement) -> None:
        """Scroll ``element`` to just under the header (at once: no smooth scrolling)."""
        self.driver.execute_script(
            "window.scrollTo({top: arguments[0].getBoundingClientRect().top + scrollY - 80,"
            " behavior: 'instant'})",
            element,
        )

    def navigation(self) -> None:
        self.open(self.base)
        labels = [
            e.get_attribute("textContent").strip()
            for e in self.driver.find_elements(
                By.CSS_SELECTOR, "nav.md-nav--primary > ul > li.md-nav__item--section > label"
            )
        ]
        self.expect(labels == SECTIONS, f"navigation sections {labels}, expected {SECTIONS}")
        print(f"navigation: {labels}")
        target = self.driver.find_element(By.LINK_TEXT, FIRST_STEP)
        target.click()
        self.wait.until(ec.url_contains("quickstart"))
        h1 = self.driver.find_element(By.CSS_SELECTOR, "article h1").text
        print(f"click {FIRST_STEP!r}: {self.page(self.driver.current_url)} -> {h1!r}")

    def search(self) -> None:
        """Search (lunr in a web worker) for a variable: the configuration page is a result."""
        self.open(self.base)
        box = self.wait.until(
            ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
        )
        box.click()  # opens the search dialog, as a reader does
        box.send_keys(VARIABLE)
        self.wait.until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a[href]")
        )
        hrefs = [
            a.get_attribute("href")
            for a in self.driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
        ]
        meta = self.driver.find_element(By.CSS_SELECTOR, ".md-search-result__meta").text
        self.driver.save_screenshot(str(self.out / "search.png"))
        found = any("reference/configuration/" in h for h in hrefs)
        self.expect(found, f"search {VARIABLE!r}: the configuration page is not a result")
        print(f"search {VARIABLE!r}: {meta!r}; configuration page found: {found}; search.png")

    def copy_buttons(self) -> None:
        """Every code block of the tutorial has Material's copy-to-clipboard button."""
        self.open(self.base + "quickstart/")
        blocks = self.driver.find_elements(By.CSS_SELECTOR, "article pre")
        bare = [b for b in blocks if not b.find_elements(By.CSS_SELECTOR, COPY_BUTTON)]
        self.expect(bool(blocks), "quickstart: no code block")
        self.expect(not bare, f"quickstart: {len(bare)} of {len(blocks)} code blocks, no copy")
        print(f"copy buttons: {len(blocks) - len(bare)} of {len(blocks)} code blocks")

    def api_headings(self) -> None:
        """Each API page's entries and contents (read by the crawl) show public names only;
        a lazily loaded class is headed ``shardcache.WebDataset``."""
        count = sum(len(names) for names in self.api_names.values())
        private = [
            f"{self.page(url)}: {name}"
            for url, names in self.api_names.items()
            for name in names
            if "shardcache._" in name
        ]
        self.expect(count > 0, "API pages: no entry")
        self.expect(not private, f"API pages name private modules: {private}")
        self.open(self.base + "reference/api/datasets/")
        heading = self.driver.find_element(By.ID, "shardcache.WebDataset").text
        self.expect(heading.startswith("shardcache.WebDataset"), f"API heading {heading!r}")
        print(
            f"API pages: {len(self.api_names)}, {count} headings and contents entries, none private"
        )


def _is_page(url: str) -> bool:
    path = urlsplit(url).path
    return path.endswith("/") or path.endswith(".html")


def check(site: Path, out: Path) -> list[str]:
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    with tempfile.TemporaryDirectory() as profile:
        driver = browser(profile)
        try:
            check = Check(driver, base, out)
            for step in (
                check.crawl,
                check.tour,
                check.navigation,
                check.search,
                check.copy_buttons,
                check.api_headings,
            ):
                started = time.monotonic()
                step()
                print(f"  ({step.__name__}: {time.monotonic() - started:.1f} s)")
        finally:
            driver.quit()
            server.shutdown()
    print(f"screenshots: {out}")
    return check.failures


if __name__ == "__main__":
    started = time.monotonic()
    failures = check(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"check-site: {time.monotonic() - started:.0f} s")
    if failures:
        sys.exit(f"check-site: {len(failures)} FAILED:\n" + "\n".join(failures))
    print("check-site: every check passed")
