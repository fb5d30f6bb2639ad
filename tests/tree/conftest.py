"""Tree packing tests share two CPU cores with other suites: one torch thread while they run.

Hypothesis settings are applied per test (`tree_strategies.tree_settings`), not as a global
profile, so other folders' property tests keep their own.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
