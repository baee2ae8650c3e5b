"""Test configuration: GPU marker handling, a deterministic hypothesis profile, fresh Dynamo state."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_schedule_cache(tmp_path_factory):
    """Measured schedule choices and the device's cost-model calibration go to a folder of this
    test: a choice cached, or a calibration measured, by another test or run (or the user's own
    cache) never changes what a test compiles, and the tests write nothing outside."""
    old = os.environ.get("CAPTUREPASS_CACHE_DIR")
    os.environ["CAPTUREPASS_CACHE_DIR"] = str(tmp_path_factory.mktemp("schedule_cache"))
    yield
    if old is None:
        os.environ.pop("CAPTUREPASS_CACHE_DIR", None)
    else:
        os.environ["CAPTUREPASS_CACHE_DIR"] = old


@pytest.fixture
def no_tf32():
    """float32 on CUDA without TF32 (matmuls and cuDNN's convolutions), as the GPU tests compare
    with eager at float32's tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_leaked_annotations():
    """Restores torch.fx.traceback's annotation state after each test.

    When Dynamo hits a graph break inside ``torch.fx.traceback.annotate`` (which
    ``capturepass.lane`` is), torch leaves the annotation in its process-global
    ``current_meta``, and every graph traced afterwards in the process inherits the
    hint (see README, Limitations). One test exercises exactly that; the others must
    not inherit it.
    """
    import torch.fx.traceback as fx_traceback

    saved = dict(fx_traceback.current_meta)
    yield
    fx_traceback.current_meta.clear()
    fx_traceback.current_meta.update(saved)
