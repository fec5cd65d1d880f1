"""Whether the optional GPU packages can be imported, asked without importing them."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def missing(module: str, extra: str) -> str | None:
    """None when `module` is importable, else a sentence saying how to install it."""
    if importlib.util.find_spec(module) is None:
        return f"the Python module {module!r} is not installed (pip install 'jax-dsrelu[{extra}]')"
    return None
