"""Our top-level package names are ours in the environment the tests run in.

`kernels/` is a namespace package (no __init__.py). A distribution that installs a regular
top-level `kernels` package wins the import over it wherever the two meet on sys.path, and a
non-editable install of both puts their files into one site-packages/kernels directory. Hugging
Face's `kernels` distribution is one: transformers requires it from 5.25, so pyproject.toml pins
the test extra's transformers below that. This says so by name instead of failing elsewhere
with a path that points into the wrong package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("base", "control_plane", "worker", "kernels", "pagedkv", "bench")

# every installed distribution's top-level names, read once (it walks all their metadata)
owners = functools.cache(importlib.metadata.packages_distributions)


@pytest.mark.parametrize("name", OURS)
def test_no_installed_distribution_brings_a_package_of_our_name(name):
    others = sorted(set(owners().get(name, [])) - {"pagedkv"})
    assert not others, (
        f"installed distribution(s) {others} provide a top-level `{name}` package, which shadows or "
        f"merges with pagedkv's; uninstall them (a newer transformers pulls Hugging Face's `kernels`)"
    )


def test_the_kernels_modules_import_from_this_tree():
    module = importlib.import_module("kernels.cpu_build")
    assert Path(module.__file__).resolve().parent == ROOT / "kernels", module.__file__
