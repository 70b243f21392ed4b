"""Helpers the tests share: generated data, multi-process harnesses, the wheel build, and where the checkout is."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout's root
