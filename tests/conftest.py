"""Shared pytest setup: every test runs MindSpore on the CPU; the two tiers.

Unit tier (`bash scripts/test.sh unit`, under 2 minutes on 2 cores): everything not marked
`integration` or `slow`. Integration tests start msrun jobs, supervised training children, servers
or whole stages; a module listed in INTEGRATION_MODULES is marked as a whole, and a single test
elsewhere can carry `@pytest.mark.integration`. CI runs every tier.
"""

import mindspore as ms
import pytest

import flows  # noqa: F401  (Prefect's embedded-server startup timeout, set before any test imports Prefect; children inherit it)

ms.set_device("CPU")  # must run once, before the first MindSpore op

INTEGRATION_MODULES = {
    "test_distributed",
    "test_flows",
    "test_pretrain",
    "test_finetune",
    "test_export",
    "test_serving",
    "test_precision",
    "test_faults_training",
    "test_convert",
    "test_dask",
    "test_server",
    "test_tensorboard",
    "test_workpool",
    "test_scaleout",
    "test_install",
    "test_eval",
    "test_data",
    "test_lora",
    "test_memory",
    "test_zero",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)
