"""Test-wide settings: run programs eagerly unless a test asks for Inductor (compiles cost seconds),
and compile in the foreground (tests of compiled programs check what Inductor built; the tiered
path, HOAD_COMPILE=background, has its own tests), with no progress reports."""

import os

os.environ.setdefault("HOAD_DEFAULT_BACKEND", "eager")
os.environ.setdefault("HOAD_COMPILE", "wait")
os.environ.setdefault("HOAD_PROGRESS", "0")  # (builds' progress reports have their own tests)
