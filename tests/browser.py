"""A real headless Chromium for the console's tests, installed by the repo's own script.

scripts/ensure-chromium.sh installs Debian's ``chromium`` and ``chromium-driver`` when they are
missing (root and apt-get), as tests/pg.py does for PostgreSQL. Selenium drives the system's
chromedriver (never one it downloads: the driver's path is given, so Selenium Manager is not
consulted, and SE_OFFLINE forbids it anyway). Each browser gets a fresh profile directory.

Skipped only when Chromium cannot be had: not installed and not root, or no apt-get. Under CI
($CI set) it is never skipped: a missing browser fails the tests (tests/envguard.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ensure-chromium.sh"

#: Headless, and nothing that talks to the network or to a desktop on its own.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-extensions", "--disable-default-apps", "--mute-audio",
         "--window-size=1280,900", "--lang=en-US", "--force-device-scale-factor=1"]


def cannot_run_reason() -> str | None:
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    if os.geteuid() != 0:
        return "Chromium or its driver is not installed and we are not root: cannot install them"
    if shutil.which("apt-get") is None:
        return "Chromium is not installed and there is no apt-get to install Debian's chromium"
    return None


def ensure() -> tuple[str, str]:
    """(chromium, chromedriver) paths, installing Debian's packages if needed; skip or fail."""
    reason = cannot_run_reason()
    if reason:
        unavailable(reason)
    try:
        proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        unavailable("scripts/ensure-chromium.sh did not finish within 15 minutes")
    if proc.returncode != 0:
        unavailable(f"scripts/ensure-chromium.sh failed: {proc.stderr[-1500:]}")
    lines = proc.stdout.split()
    try:
        import selenium  # noqa: F401
    except ImportError:
        unavailable("selenium is not installed (pip install -e '.[test]')")
    return lines[0], lines[1]


class Browser:
    """One headless Chromium with a fresh profile and a download directory; ``quit()`` ends it
    and removes the profile."""

    def __init__(self, chromium: str, chromedriver: str, downloads: Path):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        os.environ.setdefault("SE_OFFLINE", "true")
        self.profile = Path(tempfile.mkdtemp(prefix="dpsketch-chromium-"))
        self.downloads = downloads
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.add_experimental_option("prefs", {
            "download.default_directory": str(downloads), "download.prompt_for_download": False,
            "safebrowsing.enabled": False})
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = Service(executable_path=chromedriver, log_output=str(self.profile / "chromedriver.log"))
        self.driver = webdriver.Chrome(options=options, service=service)
        self.driver.set_script_timeout(30)
        self.driver.execute_cdp_cmd("Browser.setDownloadBehavior",
                                    {"behavior": "allow", "downloadPath": str(downloads)})

    def quit(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
