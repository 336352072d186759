"""Shared test helpers: the error measure and per-dtype tolerances (the same ones `lmkernels check` uses)."""

from lmkernels.check import TOL, rel_err  # noqa: F401
