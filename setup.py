"""Package discovery; every other setting is in ``pyproject.toml``.

Every package under ``batchgen_data/`` is found, and every package under ``operators/`` installs
as ``batchgen_data.operators...`` (the folder stays at the top of the repo; no generic top-level
``operators`` module lands in site-packages). A new subpackage needs no edit here.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["batchgen_data", "batchgen_data.*"]),
        *(f"batchgen_data.{name}" for name in find_packages(include=["operators", "operators.*"])),
    ],
    package_dir={"batchgen_data.operators": "operators"},
)
