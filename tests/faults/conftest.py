"""Every test here injects a fault; they run in `make test` (marker `faults` selects them alone)."""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)
