"""The pages a person opens, as a browser shows them: ``demo.html`` and ``diagnose/diagnosis.html`` of a demo's
output rendered by headless Chromium (Debian's ``chromium`` package) into ``docs/pages/*.png``, the README's
pictures. Not part of the test suite (CI has no browser; the suite checks the HTML itself).

    python benchmarks/screenshots.py --demo dutycycle-demo          # pages of a demo already run
    python benchmarks/screenshots.py --run-demo                     # run `dutycycle demo` first (a few minutes)

Each page is rendered at a fixed width into a tall window, and the blank space below its end is cut off; a page
taller than the window is rendered again in a taller one. ``docs/pages/pages.json`` (written last) names the
source page, the browser's version and each picture's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"demo": "demo.html", "diagnosis": os.path.join("diagnose", "diagnosis.html")}
MAX_HEIGHT = 16000


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("no Chromium found: install Debian's package (apt-get install chromium), then run this again")


def render(chrome: str, page: str, png: str, width: int) -> tuple[int, int]:
    """Render ``page`` into ``png``; returns the picture's (width, height) once the blank below is cut off."""
    from PIL import Image, ImageChops

    height = 3000
    while True:
        with tempfile.TemporaryDirectory() as profile:  # a fresh profile: nothing of a previous run leaks in
            cmd = [chrome, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png}",
                   "file://" + os.path.abspath(page)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0 or not os.path.exists(png):
            sys.exit(f"Chromium could not render {page}: {proc.stderr[-2000:]}")
        with Image.open(png) as im:
            rgb = im.convert("RGB")
        box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, (255, 255, 255))).getbbox()
        bottom = box[3] if box else rgb.height
        if bottom < rgb.height - 10 or height >= MAX_HEIGHT:
            cut = rgb.crop((0, 0, rgb.width, min(rgb.height, bottom + 24)))
            cut.save(png, optimize=True)
            return cut.size
        height = min(MAX_HEIGHT, height * 2)  # the page reached the window's bottom: render it taller


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default="dutycycle-demo", help="a demo's output folder (default ./dutycycle-demo)")
    ap.add_argument("--run-demo", action="store_true", help="run `dutycycle demo --out DEMO` first")
    ap.add_argument("--small", action="store_true", help="with --run-demo: the quick demo")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "pages"))
    ap.add_argument("--width", type=int, default=1200)
    args = ap.parse_args(argv)
    chrome = browser()
    if args.run_demo:
        cmd = [shutil.which("dutycycle") or "dutycycle", "demo", "--out", args.demo] + (["--small"] if args.small else [])
        subprocess.run(cmd, check=True)
    os.makedirs(args.out, exist_ok=True)
    version = subprocess.run([chrome, "--version"], capture_output=True, text=True).stdout.strip()
    made = {}
    for name, rel in PAGES.items():
        page = os.path.join(args.demo, rel)
        if not os.path.exists(page):
            sys.exit(f"{page} is not there: run the demo first (--run-demo), or point --demo at its output")
        png = os.path.join(args.out, f"{name}.png")
        w, h = render(chrome, page, png, args.width)
        made[name] = {"page": rel, "png": os.path.basename(png), "width": w, "height": h}
        print(f"{page} -> {png} ({w}x{h})")
    with open(os.path.join(args.out, "pages.json"), "w") as f:  # the manifest, last
        json.dump({"browser": version, "pages": made}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
