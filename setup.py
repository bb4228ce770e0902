"""A thin shim for tools that still call `python setup.py ...`: everything (the name, the pinned
dependencies, the console scripts, the namespace packages) is declared in pyproject.toml."""
from setuptools import setup

setup()
