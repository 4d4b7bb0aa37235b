"""Shared fixtures: make the crafted-run helpers (``tests/fakes.py``) importable and picklable by
value for submitit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cloudpickle  # noqa: E402
import fakes  # noqa: E402

# submitit subprocesses cannot import the tests folder: ship the fake training by value.
cloudpickle.register_pickle_by_value(fakes)
