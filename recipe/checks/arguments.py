"""Argument types the proof tools' command lines share: a count out of range is argparse's usage
error (exit 2, naming the option and the range), not a traceback from hypothesis or a pass over
zero cases, which would read as exit 0 (passed) or 1 (a finding)."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse `type`: a whole number, `minimum` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    return parse
