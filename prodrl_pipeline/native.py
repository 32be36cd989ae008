"""Kernels compiled at install (pyproject.toml's optional extensions), loaded through ctypes.

Each is a shared library whose `<name>_abi()` returns the version of its calling convention. A
kernel that was not built (no C compiler at install), does not load, or is a stale build is passed
over, logged, and its caller computes the same result with torch.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

log = logging.getLogger(__name__)

Signature = tuple[type | None, list[type]]
"""A kernel function's result type (None: void) and argument types."""


def built(module: str) -> str | None:
    """The file of extension `module` for this interpreter, if the install built one."""
    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None else None


def load(
    path: str | None, abi_symbol: str, abi: int, functions: dict[str, Signature], instead: str
) -> ctypes.CDLL | None:
    """The library at `path` with `functions` typed, or None if there is none, it does not load,
    it lacks a function, or its `abi_symbol` is not `abi`; `instead` says what is used then."""
    if path is None:
        log.info("no compiled kernel for %s: %s", abi_symbol.removesuffix("_abi"), instead)
        return None
    try:
        lib = ctypes.CDLL(path)
        version = getattr(lib, abi_symbol)
        typed = {name: getattr(lib, name) for name in functions}
    except (OSError, AttributeError) as e:
        log.warning("the kernel %s does not load (%s): %s", path, e, instead)
        return None
    version.restype = ctypes.c_int64
    if version() != abi:
        log.warning("the kernel %s is a stale build (reinstall): %s", path, instead)
        return None
    for name, (restype, argtypes) in functions.items():
        typed[name].restype, typed[name].argtypes = restype, argtypes
    return lib
