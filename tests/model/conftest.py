"""Fixtures shared by the model tests."""

import pytest

from batchgen_data.model.native import load_native


@pytest.fixture(scope="module")
def native():
    """The compiled CPU kernels, or a skip where they do not build here."""
    module = load_native()
    if module is None:
        pytest.skip("the native kernels do not build here (no C++ compiler or torch headers)")
    return module
