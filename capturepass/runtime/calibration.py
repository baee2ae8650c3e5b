"""The cost model calibrated from measured kernel times, per device, on disk.

The measured lane choice (``runtime.pick``) replays every candidate schedule of a shape as a
captured graph and times it. The one-lane candidate's replay is the graph's kernels back to
back, so its time is a measurement of the kernels the cost model estimates node by node:
each such measurement becomes a *sample*, the graph's nominal rooflines (``ir.cost.roofline``
of every kernel node, counted) and the measured time. :func:`ir.cost.fit` fits a
:class:`~capturepass.ir.cost.DeviceModel` to a device's samples (a scale on the roofline and
a launch floor per kernel). The schedules nothing measures, those of the graphs compiled
afterwards on that device that run uncaptured (``cudagraphs="none"``) or breakable, come from
it: their estimates are then in the device's microseconds, weighed against the right times
by the scheduler's fixed costs (an event record and wait, ``merge_lanes_below_us``). A
captured graph's candidates stay the nominal model's: its measured choice is cached by
candidate name, which must keep meaning the same schedule in the next process.

The same measurements also price the lanes themselves. Where the cost model's schedule and one
lane's own compile were both measured, a *lane sample* keeps the ratio of their makespans the
cost model estimated and the ratio of their replays: the lanes' program pays costs the model
does not see (its sync points bound Inductor's fusion, no buffer is reused across lanes), so
on the H200 the measured ratio ran 1.24 to 1.48 times the estimated one. The device's *lane
factor* (:meth:`CalibrationStore.lane_factor`, the median of measured over estimated) turns a
new graph's estimated ratio into a predicted one (:func:`lanes_predicted`): a graph whose lanes
are predicted to be no faster than one lane is compiled with one lane alone (the backend
route: one Inductor compile instead of two) or left as it was (the pass route, which cannot
measure).

One JSON file per device in the schedule cache's folder (``calibration-<digest>.json``),
holding the latest :data:`MAX_SAMPLES` samples (one per graph and shape; a shape measured
again replaces its sample) and the model fitted to them, written atomically. The choice's
off switch (``pick="model"``) turns calibration off too: schedules then come from the
nominal model alone, the same on every machine.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import statistics
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch.fx as fx

from capturepass.ir import cost, meta
from capturepass.runtime import files

# Bumped when what a sample measures changes (2: the picker's samples are replays back to back,
# after a lead-in, where they were single replays from an idle stream).
FORMAT = 2
# Samples kept per device: the latest graphs and shapes measured.
MAX_SAMPLES = 64


def lanes_predicted(estimated_ratio: float, factor: float) -> float:
    """The predicted ratio of a graph's lanes to one lane (below 1: the lanes are faster), from
    the cost model's ratio of the two makespans and the device's lane factor."""
    return estimated_ratio * factor


def rooflines(graph: fx.Graph) -> list[tuple[float, int]]:
    """The nominal roofline (seconds, 3 significant digits) of every kernel node of ``graph``,
    with how many nodes have it (a model's layers repeat a few costs many times)."""
    counts: dict[float, int] = {}
    for node in graph.nodes:
        info = meta.info(node) if node.op == "call_function" else None
        r = cost.roofline(info.cost) if info is not None else 0.0
        if r > 0 and math.isfinite(r):
            key = float(f"{r:.3g}")
            counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items())


class CalibrationStore:
    """The devices' samples and fitted models in ``directory`` (made at the first write)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self._lock = threading.Lock()

    def path(self, device: str) -> str:
        """The file of ``device`` (a digest of its name: names hold spaces and slashes)."""
        digest = hashlib.sha256(device.encode()).hexdigest()[:16]
        return os.path.join(self.directory, f"calibration-{digest}.json")

    def _read(self, device: str) -> dict[str, Any] | None:
        path = self.path(device)
        data = files.read_json(path, "capturepass: the calibration file %s cannot be read (%s: %s); the cost model "
                                     "starts from its nominal device")
        if data is None:
            return None
        if isinstance(data, dict) and data.get("device") == device and isinstance(data.get("format"), int) \
                and data["format"] < FORMAT:
            # Samples of an earlier kind of measurement: not mixed with this one's, replaced by it.
            files.warn_once(f"read:{path}", "capturepass: %s holds samples of an earlier format (%d); the cost "
                            "model starts from its nominal device and the next measurement replaces them", path,
                            data["format"], level=logging.INFO)
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("device") != device \
                or not isinstance(data.get("samples"), list):
            files.warn_once(f"read:{path}", "capturepass: %s is not a calibration file of %s; the cost model "
                            "starts from its nominal device", path, device)
            return None
        return data

    def model(self, device: str) -> cost.DeviceModel | None:
        """The model fitted to ``device``'s samples, or ``None`` (none yet, or unreadable)."""
        data = self._read(device)
        m = data.get("model") if data is not None else None
        if not isinstance(m, dict):
            return None
        try:
            scale, floor_s, n = float(m["scale"]), float(m["launch_floor_s"]), int(m["samples"])
        except (KeyError, TypeError, ValueError):
            files.warn_once(f"read:{self.path(device)}", "capturepass: the calibration file %s holds no valid model; "
                            "the cost model starts from its nominal device", self.path(device))
            return None
        if not (math.isfinite(scale) and scale > 0 and math.isfinite(floor_s) and floor_s >= 0 and n > 0):
            return None
        return cost.DeviceModel(name=device, scale=scale, launch_floor_s=floor_s, samples=n)

    def add(self, device: str, key: str, graph_rooflines: Sequence[tuple[float, int]],
            measured_s: float) -> cost.DeviceModel | None:
        """Adds (or replaces) the sample of ``key`` (a graph and shape), refits the device's
        model and writes both; returns the new model (``None``: nothing to fit). A file that
        cannot be written is warned about once; the model still comes back."""
        if not graph_rooflines or not (measured_s > 0 and math.isfinite(measured_s)):
            return None
        with self._lock:
            data = self._read(device) or {"format": FORMAT, "device": device, "samples": []}
            samples = [s for s in data["samples"] if isinstance(s, dict) and s.get("key") != key]
            samples.append({"key": key, "rooflines": [[r, c] for r, c in graph_rooflines], "measured_s": measured_s})
            samples = samples[-MAX_SAMPLES:]
            fitted = cost.fit(list(_parsed(samples)), device)
            data = {**data, "samples": samples,
                    "model": {"scale": fitted.scale, "launch_floor_s": fitted.launch_floor_s,
                              "samples": fitted.samples}}
            self._write(device, data)
        return fitted

    def add_lanes(self, device: str, key: str, estimated: float, measured: float) -> float | None:
        """Adds (or replaces) the lane sample of ``key`` (a graph and shape): the cost model's
        schedule over one lane's, ``estimated`` (makespans) and ``measured`` (replays); writes
        it and returns the device's new lane factor (``None``: not a valid sample)."""
        if not all(math.isfinite(v) and v > 0 for v in (estimated, measured)):
            return None
        with self._lock:
            data = self._read(device) or {"format": FORMAT, "device": device, "samples": []}
            lanes = [s for s in data.get("lanes", []) if isinstance(s, dict) and s.get("key") != key]
            lanes.append({"key": key, "estimated": estimated, "measured": measured})
            data = {**data, "lanes": lanes[-MAX_SAMPLES:]}
            self._write(device, data)
        return _factor(data["lanes"])

    def lane_factor(self, device: str) -> float | None:
        """The median of measured over estimated lane ratios of ``device``'s lane samples, or
        ``None`` (none yet, or unreadable)."""
        data = self._read(device)
        return _factor(data.get("lanes", [])) if data is not None else None

    def _write(self, device: str, data: dict[str, Any]) -> None:
        files.write_json(self.path(device), data, "capturepass: cannot write the calibration in %s (%s); the cost "
                                                  "model is recalibrated in this process only")


def _factor(lanes: Iterable[Any]) -> float | None:
    ratios = []
    for s in lanes:
        try:
            estimated, measured = float(s["estimated"]), float(s["measured"])
        except (KeyError, TypeError, ValueError):
            continue  # a malformed sample is left out, as in the fit
        if math.isfinite(estimated) and math.isfinite(measured) and estimated > 0 and measured > 0:
            ratios.append(measured / estimated)
    return statistics.median(ratios) if ratios else None


def _parsed(samples: Iterable[dict[str, Any]]) -> Iterable[tuple[list[tuple[float, int]], float]]:
    for s in samples:
        try:
            yield [(float(r), int(c)) for r, c in s["rooflines"]], float(s["measured_s"])
        except (KeyError, TypeError, ValueError):
            continue  # a malformed sample (another writer's, or edited by hand) is left out of the fit


