"""Test-wide settings: run programs eagerly unless a test asks for Inductor (compiles cost seconds)."""

import os

os.environ.setdefault("HOAD_DEFAULT_BACKEND", "eager")
