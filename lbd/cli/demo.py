"""Placeholder; replaced by its owner."""

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Placeholder."""
