"""Check an HTML run report (agentflash/report.py) in headless Chromium.

    python tools/check_report.py REPORT.html --screenshot out.png

One headless run takes a screenshot and dumps the rendered DOM. The page passes when the
screenshot is a PNG of the window's size and of non-trivial content, the rendered DOM holds as
many <svg> elements as the file (a broken document drops or swallows charts), and the page wrote
nothing to the console. The report has no scripts, so any console message from the page
("Uncaught ..." included) is a problem; Chromium's own log lines (dbus, GPU) are not console
messages and are ignored. Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
WINDOW = (1400, 3000)
MIN_PNG_BYTES = 50_000     # a blank page at WINDOW is ~19 kB, the smallest report ~120 kB
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SVG = re.compile(r"<svg[\s>]", re.IGNORECASE)
# e.g. [..:INFO:CONSOLE:1] "Uncaught Error: x", source: file:///tmp/r.html (1)
CONSOLE = re.compile(r':CONSOLE[:(]\d*\)?\] (".*)$')


def check(html_path: str | Path, screenshot: str | Path, chromium: str = CHROMIUM,
          window: tuple[int, int] = WINDOW) -> list[str]:
    """Render `html_path` to `screenshot`; the problems found (empty: the page is fine)."""
    page, shot = Path(html_path).resolve(), Path(screenshot).resolve()
    if shutil.which(chromium) is None:
        return [f"chromium not found at {chromium}"]
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
             "--v=0", f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}",
             f"--screenshot={shot}", "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120)
    problems = []
    if proc.returncode != 0:
        problems.append(f"chromium exited with status {proc.returncode}: "
                        f"{proc.stderr.strip()[-500:]}")
    problems += png_problems(shot, window)
    expected, rendered = len(SVG.findall(page.read_text(encoding="utf-8"))), len(
        SVG.findall(proc.stdout))
    if rendered != expected:
        problems.append(f"the rendered page has {rendered} <svg> elements, the file {expected}")
    problems += [f"console: {m}" for m in console_messages(proc.stderr)]
    return problems


def png_problems(path: Path, window: tuple[int, int]) -> list[str]:
    if not path.is_file():
        return [f"no screenshot written at {path}"]
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC) or data[12:16] != b"IHDR":
        return [f"{path} is not a PNG"]
    problems = []
    size = struct.unpack(">II", data[16:24])
    if size != window:
        problems.append(f"screenshot is {size[0]}x{size[1]}, expected {window[0]}x{window[1]}")
    if len(data) < MIN_PNG_BYTES:
        problems.append(f"screenshot has only {len(data)} bytes: the page looks empty")
    return problems


def console_messages(stderr: str) -> list[str]:
    """The page's console messages in Chromium's stderr log."""
    return [m.group(1) for line in stderr.splitlines() if (m := CONSOLE.search(line))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="the HTML report to check")
    parser.add_argument("--screenshot", type=Path, required=True, help="where to write the PNG")
    parser.add_argument("--chromium", default=CHROMIUM)
    args = parser.parse_args()
    problems = check(args.report, args.screenshot, args.chromium)
    for p in problems:
        print(f"FAIL {p}")
    if not problems:
        print(f"ok: {args.report} rendered to {args.screenshot}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
