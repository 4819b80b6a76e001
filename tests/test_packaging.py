"""The install layout: ``operators/`` ships as ``batchgen_data.operators``, never top-level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_operators_install_under_the_package_only(tmp_path):
    code = (
        "import importlib.util, batchgen_data.operators as o, batchgen_data as b;"
        "print(importlib.util.find_spec('operators'));"
        "print(o.__name__, o.__file__);"
        "print(b.BatchGenOperator.__module__, b.BatchGenMap.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    spec, operators, exports = out.stdout.splitlines()
    assert spec == "None"  # no generic top-level `operators` module in site-packages
    name, path = operators.split()
    assert name == "batchgen_data.operators" and Path(path).parent == REPO / "operators"  # editable install
    assert exports == "batchgen_data.operators.ray_operator batchgen_data.operators.datasets_map"


def test_importing_the_package_has_no_side_effects(tmp_path):
    code = (
        "import logging, os, sys; before = dict(os.environ);"
        "import batchgen_data;"
        "assert dict(os.environ) == before, 'environment changed';"
        "assert not logging.getLogger().handlers, 'logging configured';"
        "assert 'ray' not in sys.modules and 'pyarrow' not in sys.modules, 'heavy imports'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
