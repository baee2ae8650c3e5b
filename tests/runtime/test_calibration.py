"""The cost model calibrated from measured one-lane replays: samples on disk, the fitted model,
and the graphs compiled afterwards scheduling with it (on the CPU: measurements are given)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from capturepass.backends import dynamo
from capturepass.ir import cost, meta
from capturepass.ir.meta import Cost
from capturepass.ir.options import Options
from capturepass.runtime import calibration, files
from capturepass.runtime.calibration import CalibrationStore
from tests.helpers import aten_graph, run_passes

DEVICE = "FakeGPU sm90"
GRAPHS = [
    [(1e-6, 100), (5e-6, 20), (4e-5, 8)],
    [(2e-7, 300), (1e-5, 10)],
    [(8e-5, 40), (1e-6, 5)],
]


def test_samples_fit_a_model_that_another_process_reads(tmp_path):
    store = CalibrationStore(tmp_path / "cache")
    assert store.model(DEVICE) is None
    models = [store.add(DEVICE, f"g{i}", r, cost.predicted(r, 0.5, 3e-6)) for i, r in enumerate(GRAPHS)]
    assert [m.samples for m in models] == [1, 2, 3]
    again = CalibrationStore(tmp_path / "cache").model(DEVICE)
    assert again == models[-1] and again.launch_floor_s == 3e-6 and again.scale == pytest.approx(0.5, rel=0.03)
    assert CalibrationStore(tmp_path / "cache").model("OtherGPU sm80") is None  # per device
    (path,) = os.listdir(tmp_path / "cache")
    assert path.startswith("calibration-") and path.endswith(".json")


def test_a_shape_measured_again_replaces_its_sample_and_old_samples_go(tmp_path, monkeypatch):
    store = CalibrationStore(tmp_path)
    store.add(DEVICE, "g0", GRAPHS[0], 1e-3)
    store.add(DEVICE, "g0", GRAPHS[0], 2e-3)
    data = json.load(open(store.path(DEVICE)))
    assert [(s["key"], s["measured_s"]) for s in data["samples"]] == [("g0", 2e-3)]
    monkeypatch.setattr(calibration, "MAX_SAMPLES", 2)
    for key in ("g1", "g2"):
        store.add(DEVICE, key, GRAPHS[1], 1e-3)
    data = json.load(open(store.path(DEVICE)))
    assert [s["key"] for s in data["samples"]] == ["g1", "g2"] and data["model"]["samples"] == 2


def test_nothing_to_fit_adds_nothing(tmp_path):
    store = CalibrationStore(tmp_path)
    assert store.add(DEVICE, "g0", [], 1e-3) is None
    assert store.add(DEVICE, "g0", GRAPHS[0], 0.0) is None
    assert not os.path.exists(store.path(DEVICE))


@pytest.mark.parametrize("content", ["{not json",
                                     json.dumps({"format": calibration.FORMAT, "device": "x", "samples": []}),
                                     json.dumps({"format": calibration.FORMAT, "device": DEVICE, "samples": [],
                                                 "model": {"scale": "a"}})])
def test_a_bad_file_warns_once_and_the_model_is_nominal(tmp_path, caplog, content):
    store = CalibrationStore(tmp_path)
    with open(store.path(DEVICE), "w") as f:
        f.write(content)
    files._warned.clear()
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        assert store.model(DEVICE) is None and store.model(DEVICE) is None
    assert len([r for r in caplog.records if "calibration" in r.getMessage()]) == 1
    assert store.add(DEVICE, "g0", GRAPHS[0], 1e-3).samples == 1  # a measurement starts it afresh


def test_samples_of_an_earlier_format_are_replaced_without_a_warning(tmp_path, caplog):
    """A file an earlier capturepass wrote (its samples measured another way) is not mixed with
    this one's: the model is nominal until the next measurement replaces it (logged at INFO)."""
    store = CalibrationStore(tmp_path)
    with open(store.path(DEVICE), "w") as f:
        json.dump({"format": calibration.FORMAT - 1, "device": DEVICE, "samples": [], "model": None}, f)
    files._warned.clear()
    with caplog.at_level(logging.INFO, logger="capturepass"):
        assert store.model(DEVICE) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "holds samples of an earlier format" in caplog.text
    assert store.add(DEVICE, "g0", GRAPHS[0], 1e-3).samples == 1
    with open(store.path(DEVICE)) as f:
        assert json.load(f)["format"] == calibration.FORMAT


def test_an_unwritable_folder_warns_once_and_the_model_still_comes_back(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = CalibrationStore(blocker / "cache")
    files._warned.clear()
    with caplog.at_level(logging.WARNING, logger="capturepass"):
        assert store.add(DEVICE, "g0", GRAPHS[0], 1e-3).samples == 1
        assert store.add(DEVICE, "g1", GRAPHS[1], 1e-3).samples == 1  # nothing was kept
    assert len([r for r in caplog.records if "cannot write the calibration" in r.getMessage()]) == 1


def test_a_graphs_rooflines_count_its_kernel_nodes():
    def f(x, w):
        return torch.relu(x @ w).view(-1), (x @ w).sum()

    gm = aten_graph(f, torch.randn(64, 64), torch.randn(64, 64))
    run_passes(gm, "annotate_capabilities")
    got = calibration.rooflines(gm.graph)
    kernels = [n for n in gm.graph.nodes if n.op == "call_function" and cost.roofline(meta.info(n).cost) > 0]
    assert sum(c for _, c in got) == len(kernels) >= 4  # two mm, relu, sum; the view is free
    mm = float(f"{cost.roofline(Cost(flops=2 * 64**3, bytes=3 * 64 * 64 * 4)):.3g}")
    assert dict(got)[mm] == 2


def test_compiles_read_the_model_only_for_schedules_nothing_measures(tmp_path, monkeypatch):
    """Uncaptured and breakable graphs schedule with the calibrated model; a captured graph's
    candidates stay the nominal model's (its cached choice names one of them); pick="model"
    is the nominal model everywhere; a host graph measures nothing."""
    store = CalibrationStore(tmp_path)
    fitted = store.add(DEVICE, "g0", GRAPHS[0], 1e-3)
    monkeypatch.setattr(dynamo.choices, "device_name", lambda d: DEVICE)
    cuda = [torch.empty(2, device="meta")]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))

    def model(**options):
        return dynamo._device_model(Options.from_mapping({"pick_cache_dir": str(tmp_path), **options}), cuda)

    assert model(cudagraphs="none") == fitted and model(cudagraphs="breakable") == fitted
    assert model() is None and model(cudagraphs="monolithic") is None
    assert model(cudagraphs="none", pick="model") is None
    # The pass route's schedules are never measured, captured or not: the calibrated model.
    opts = Options.from_mapping({"pick_cache_dir": str(tmp_path)})
    assert dynamo.calibrated_model(opts, dynamo.cuda_device(cuda)) == fitted
    assert dynamo.calibrated_model(opts, None) is None
    assert dynamo.calibrated_model(Options.from_mapping({"pick_cache_dir": str(tmp_path), "pick": "model"}),
                                   dynamo.cuda_device(cuda)) is None
    monkeypatch.undo()
    assert dynamo._device_model(Options.from_mapping({"pick_cache_dir": str(tmp_path), "cudagraphs": "none"}),
                                [torch.empty(2)]) is None


def test_the_scheduler_weighs_calibrated_times_against_its_fixed_thresholds():
    """The MoE block's side lanes are busy 8 and 8 us on the nominal device, above
    ``merge_lanes_below_us=5``; on a device four times faster they are short lanes, merged back."""
    from tests.runtime.test_pick import _moe

    def lanes(model):
        f, inputs = _moe()
        gm = aten_graph(f, *inputs)
        with cost.device_model(model):
            run_passes(gm, "assign_streams", policy="auto", merge_lanes_below_us=5.0)
        return meta.graph_info(gm).lanes

    assert lanes(None) == ("main", "aux0", "aux1")
    assert lanes(cost.DeviceModel(name="fast", scale=0.25, launch_floor_s=0.5e-6, samples=3)) == ("main",)


def test_lane_samples_give_the_devices_lane_factor_and_keep_the_model(tmp_path):
    """The lanes' measured ratio to one lane over the cost model's (a median over the device's
    samples, one per graph and shape); one-lane samples and lane samples share the file."""
    store = CalibrationStore(tmp_path)
    assert store.lane_factor(DEVICE) is None
    model = store.add(DEVICE, "g0", GRAPHS[0], 1e-3)
    assert store.add_lanes(DEVICE, "g0", 0.8, 1.04) == pytest.approx(1.3)
    assert store.add_lanes(DEVICE, "g1", 0.5, 0.75) == pytest.approx(1.4)  # median of 1.3 and 1.5
    assert store.add_lanes(DEVICE, "g0", 0.8, 0.96) == pytest.approx(1.35)  # g0 measured again: 1.2 and 1.5
    assert store.add_lanes(DEVICE, "g2", 0.0, 1.0) is None  # not a sample
    again = CalibrationStore(tmp_path)
    assert again.lane_factor(DEVICE) == pytest.approx(1.35) and again.model(DEVICE) == model
    store.add(DEVICE, "g1", GRAPHS[1], 1e-3)  # refitting keeps the lane samples
    assert again.lane_factor(DEVICE) == pytest.approx(1.35) and again.lane_factor("OtherGPU sm80") is None
    assert calibration.lanes_predicted(0.7, 1.35) == pytest.approx(0.945)
