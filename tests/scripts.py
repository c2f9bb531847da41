"""The repository's scripts/ imported as modules, for tests of what they compute."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, executed afresh and registered as the module `name` (its dataclasses look their module
    up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
