"""The browser check of scripts/check-site: serve SITE on 127.0.0.1, drive headless Chromium.

Usage: python scripts/check_site.py SITE_DIR SCREENSHOT_DIR. Exits 1 naming the first check
that failed; prints what it saw and where the screenshots are.
"""

from __future__ import annotations

import functools
import http.server
import sys
import tempfile
import threading
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

# As root and on a machine without a network: no sandbox, and none of Chromium's own
# background connections (each would be refused, many at a time).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def browser(profile: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def check(site: Path, out: Path) -> None:
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    with tempfile.TemporaryDirectory() as profile:
        driver = browser(profile)
        wait = WebDriverWait(driver, 15)
        try:
            driver.get(base)
            assert "shardcache" in driver.title, driver.title
            print(f"home: {driver.title!r}")
            driver.save_screenshot(str(out / "home.png"))

            # Navigation: every page of the navigation opens and has a heading.
            links = driver.find_elements(
                By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link[href]"
            )
            hrefs = sorted({a.get_attribute("href") for a in links if a.get_attribute("href")})
            pages = [h.split("#")[0] for h in hrefs if h.startswith(base)]
            for href in sorted(set(pages)):
                driver.get(href)
                heading = driver.find_element(By.CSS_SELECTOR, "article h1").text
                assert heading, f"{href}: no heading"
            print(f"navigation: {len(set(pages))} pages open, each with a heading")

            # Clicking a navigation link moves to that page.
            driver.get(base)
            target = driver.find_element(By.LINK_TEXT, "Five-minute example")
            driver.execute_script("arguments[0].click();", target)
            wait.until(ec.url_contains("quickstart"))
            print(f"click: {driver.current_url} -> {driver.find_element(By.TAG_NAME, 'h1').text!r}")

            # Search (lunr in a web worker): results for a configuration variable.
            driver.get(base)
            box = wait.until(
                ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
            )
            box.click()  # opens the search dialog, as a reader does
            box.send_keys("SHARDCACHE_THREADS")
            wait.until(
                lambda d: any(
                    e.get_attribute("textContent")
                    for e in d.find_elements(By.CSS_SELECTOR, ".md-search-result__item h1")
                )
            )
            items = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
            meta = driver.find_element(By.CSS_SELECTOR, ".md-search-result__meta").text
            titles = [
                h.get_attribute("textContent")
                for h in driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item h1")[:5]
            ]
            print(f"search 'SHARDCACHE_THREADS': {meta!r}; first results {titles}")
            assert items, "no search result"
            driver.save_screenshot(str(out / "search.png"))

            # The API page renders ShardCache's docstring.
            driver.get(base + "reference/api/cache/")
            doc = driver.find_element(By.ID, "shardcache.ShardCache")
            body = driver.find_element(By.CSS_SELECTOR, "article").text
            assert "A per-rank (or per-node) local cache of remote shards." in body, body[:500]
            print(f"API page: heading {doc.text!r}; ShardCache's docstring is rendered")
            driver.execute_script("arguments[0].scrollIntoView();", doc)
            driver.save_screenshot(str(out / "api.png"))
        finally:
            driver.quit()
            server.shutdown()
    print(f"screenshots: {out}/home.png, search.png, api.png")


if __name__ == "__main__":
    try:
        check(Path(sys.argv[1]), Path(sys.argv[2]))
    except AssertionError as exc:
        sys.exit(f"check-site: FAILED: {exc}")
