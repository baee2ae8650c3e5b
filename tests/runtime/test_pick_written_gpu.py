"""The measured choice on a real GPU, on graphs that write a large buffer of the caller's in place.

Every test here is marked ``gpu`` and skipped without CUDA; each compiles with its own schedule
cache folder, so that a cached choice never stands in for a measurement.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from capturepass.runtime import aside
from tests.helpers import RunningSum, SlotCache

pytestmark = pytest.mark.gpu

MIB = 2**20
FP32 = dict(atol=1e-4, rtol=1e-4)


def _measured_options(tmp_path) -> dict:
    """Options under which these small graphs keep two lanes to measure: one compile per lane
    region (under the default, lanes after fusion, Inductor fuses each whole graph into kernels
    of one lane, and one lane is not measured)."""
    return {"pick_cache_dir": str(tmp_path), "regions": "lanes"}


def _measured(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if ": schedule candidate " in r.getMessage()
            and " measured " in r.getMessage()]


def test_spare_bytes_reads_what_the_gpu_can_still_allocate():
    # Only bounds: other processes (the suite's other workers) allocate on the same GPU meanwhile.
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < aside.spare_bytes(torch.device("cuda", 0)) <= total
    assert aside.spare_bytes(torch.device("cpu")) is None


@torch.no_grad()
@pytest.mark.parametrize("spare", (None, 0), ids=("copies-beside", "copies-on-the-host"))
def test_measuring_a_graph_that_writes_a_cache_holds_at_most_one_copy_of_it(spare, tmp_path, monkeypatch, caplog,
                                                                            no_tf32):
    """A 256 MiB cache written in place: the candidates' warm-ups run on copies of it, one at a
    time, and the timed replays are undone from one more; never two beside the caller's. Where
    the GPU cannot spare a copy (``aside.spare_bytes`` says none), none is made on it."""
    if spare is not None:
        monkeypatch.setattr(aside, "spare_bytes", lambda device: spare)
    torch.manual_seed(0)
    d = 1024
    model = SlotCache(slots=256 * MIB // (4 * d), d=d).cuda()
    eager = copy.deepcopy(model)
    cache = model.cache.nbytes
    compiled = torch.compile(model, backend="capturepass", dynamic=False, options=_measured_options(tmp_path))
    x = torch.randn(3, d, device="cuda")
    want = eager(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        got = compiled(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert len(_measured(caplog)) >= 2, caplog.text  # not vacuous: candidates were warmed up and timed
    torch.testing.assert_close(got, want, **FP32)
    assert torch.equal(model.n, eager.n)
    torch.testing.assert_close(model.cache, eager.cache, **FP32)
    copies = 1 if spare is None else 0
    assert peak < (copies + 1) * cache, \
        f"peak {peak / MIB:.0f} MiB above the model: more than {copies} copies of the {cache / MIB:.0f} MiB cache"


@torch.no_grad()
def test_a_written_buffer_the_gpu_cannot_copy_beside_itself_is_put_back_from_the_host(tmp_path, monkeypatch, caplog,
                                                                                     no_tf32):
    """Where the GPU has too little to spare for a copy (``spare_bytes`` says none here), the
    written buffer is copied to the host before the timed replays and back after them: a running
    sum the replays add to again ends as eager's."""
    monkeypatch.setattr(aside, "spare_bytes", lambda device: 0)
    torch.manual_seed(0)
    model = RunningSum(rows=8192, d=64).cuda()  # 2 MiB
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="capturepass", dynamic=False, options=_measured_options(tmp_path))
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for rows in (3, 3, 2):
            x = torch.randn(rows, 64, device="cuda")
            torch.testing.assert_close(compiled(x), eager(x), **FP32)
            torch.testing.assert_close(model.acc, eager.acc, **FP32)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "timed replays: the inputs the graph writes are kept on the host" in m]) == 2, messages


class _WritesItsCache(torch.nn.Module):
    """Writes the first rows of a cache the caller passes (an argument, not a buffer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[: x.shape[0]] = self.a(x) + self.b(x).relu()
        return cache[:8].sum(0)


@torch.no_grad()
def test_a_new_cache_the_gpu_cannot_copy_is_captured_where_it_lies(tmp_path, monkeypatch, caplog, no_tf32):
    """A second 256 MiB cache (a new generation's) where the GPU has no room for a copy of it
    (``aside.spare_bytes`` says none): captured in place at its address, never copied into a
    buffer of its size."""
    monkeypatch.setattr(aside, "spare_bytes", lambda device: 0)
    torch.manual_seed(0)
    d = 1024
    model = _WritesItsCache(d).cuda()
    compiled = torch.compile(model, backend="capturepass", dynamic=False, options={"pick_cache_dir": str(tmp_path)})
    rows = 256 * MIB // (4 * d)
    # Both alive at once: the second cannot take the first's block (which would not be a move).
    caches = [torch.zeros(rows, d, device="cuda") for _ in range(2)]
    refs = [torch.zeros(rows, d, device="cuda") for _ in range(2)]
    for generation, (cache, ref) in enumerate(zip(caches, refs)):
        with caplog.at_level(logging.INFO, logger="capturepass"):
            for step in range(3):
                x = torch.randn(4, d, device="cuda")
                # The peak of the compiled call alone: comparing two caches (``assert_close``) takes
                # temporaries of their size.
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                got = compiled(x, cache)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
                assert peak < cache.nbytes, \
                    f"generation {generation}, step {step}: peak {peak / MIB:.0f} MiB, a copy of the cache"
                torch.testing.assert_close(got, model(x, ref), **FP32)
                torch.testing.assert_close(cache, ref, **FP32)
    assert "captured in place there, as the device cannot spare a buffer" in caplog.text
