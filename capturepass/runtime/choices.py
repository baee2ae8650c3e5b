"""What a measured lane choice leaves behind: its record, and the cache other processes read.

:class:`PickRecord` is one shape's choice (every candidate's estimate against its measured
median); the graph's dump folder keeps them in :data:`PICKS_FILE`, which ``capturepass show``
reads. :class:`ScheduleCache` keeps each choice in a JSON file per key (device name, a hash of
the graph before lane assignment with the options that change its schedule, the shapes), and a
graph summary per graph (every shape's choice), so that another process that compiles the same
graph captures only the chosen candidate. The measuring itself is ``capturepass.runtime.pick``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from capturepass.ir.options import CACHE_DIR_ENV
from capturepass.runtime import files

PICKS_FILE = "schedules.json"
# Bumped when what a cached choice means changes (candidate names, what is timed).
CACHE_FORMAT = 3
# A graph summary's choice when its shapes chose differently.
MIXED = "mixed"


# -- the keys ----------------------------------------------------------------------------------------


def shape_text(args: Sequence[Any], skip: Sequence[int] = ()) -> str:
    """The shapes, strides and dtypes of a call's arguments (scalars by value), as one string;
    the positions in ``skip`` (the parameters, when shown to a reader) left out."""
    parts = []
    left_out = set(skip)
    for i, a in enumerate(args):
        if i in left_out:
            continue
        if isinstance(a, torch.Tensor):
            dtype = str(a.dtype).replace("torch.", "")
            parts.append(f"{dtype}{list(a.shape)}{'' if a.is_contiguous() else tuple(a.stride())}")
        elif isinstance(a, (int, float, bool)):
            parts.append(repr(a))
        else:
            parts.append(type(a).__name__)
    return "(" + ", ".join(parts) + ")"


def device_name(device: torch.device | None) -> str:
    """The name of a CUDA device and its compute capability (the cache's device key)."""
    if device is None or device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


# -- the record --------------------------------------------------------------------------------------


def round_us(x: float | None) -> float | None:
    """Microseconds to three decimals, as the records keep them."""
    return None if x is None else round(x, 3)


def workspace_mib(cap: Any) -> float | None:
    """The cuBLAS workspaces a capture allocated (``workspace_bytes``), in MiB to one decimal, as
    the records keep them; ``None`` for a capture that does not know (not a CUDA capture)."""
    n = getattr(cap, "workspace_bytes", None)
    return None if not isinstance(n, int) else round(n / 2**20, 1)


def workspace_text(mib: Any) -> str:
    """``", cuBLAS workspaces N MiB"`` for a record's ``workspace_mib``, or nothing."""
    return f", cuBLAS workspaces {mib:g} MiB" if isinstance(mib, (int, float)) and not isinstance(mib, bool) else ""


@dataclasses.dataclass
class PickRecord:
    """One shape's choice: every candidate's estimate and measured median, and the choice.

    Attributes:
        graph: the graph's kind (``"inference"``, ``"forward"``).
        shape: the shapes of the call's arguments other than its parameters (:func:`shape_text`).
        device: the CUDA device's name.
        choice: the chosen candidate's name.
        cached: the choice was read from the cache (nothing was measured).
        budget_ms: the measuring budget.
        rounds: timed rounds per candidate.
        replays: replays run in all (warm-up rounds included).
        candidates: per candidate, ``name``, ``lanes``, ``estimate_us`` (the cost model's
            makespan), ``measured_us`` (the median; ``None`` when it was not measured),
            ``fastest_us`` (its fastest sample; absent from records of an older format),
            ``workspace_mib`` (the cuBLAS workspaces its capture allocated, one per stream that
            ran a matrix product; ``None`` when not known) and ``note`` (why not measured).
        scale: the one-lane candidate's measured time over its estimate (how far the cost
            model's absolute times are off on this device), or ``None``.
        unsteady: the candidates whose median was far above their fastest sample
            (``pick.UNSTEADY``): other work shared the GPU with the timed replays, and the
            choice was neither cached nor used to calibrate the cost model.
        uncaptured: the choice of uncaptured calls (``runtime.uncaptured``): each candidate
            timed over ``rounds`` synchronised calls of the model itself (``replays`` calls in
            all, the untimed first ones included), never cached.
    """

    graph: str
    shape: str
    device: str
    choice: str
    cached: bool
    budget_ms: float
    rounds: int
    replays: int
    candidates: list[dict[str, Any]]
    scale: float | None = None
    unsteady: list[str] = dataclasses.field(default_factory=list)
    uncaptured: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the entry of :data:`PICKS_FILE` and the cache; ``uncaptured`` only
        where set, so that a captured choice's entry reads as before it existed)."""
        out = dataclasses.asdict(self)
        if not self.uncaptured:
            del out["uncaptured"]
        return out

    def text(self) -> str:
        """The one-line decision the graph record and ``show`` print."""
        chosen = next(c for c in self.candidates if c["name"] == self.choice)
        if self.uncaptured:
            return (f"uncaptured calls of {self.shape} on {self.device}: {self.choice} ({chosen['lanes']} lane(s)), "
                    f"measured fastest ({self.rounds} synchronised call(s) each, {self.replays} calls); "
                    + "; ".join(f"{c['name']} {c['lanes']} lane(s): measured {c['measured_us']} us"
                                for c in self.candidates))
        head = f"schedule for {self.shape} on {self.device}: {self.choice} ({chosen['lanes']} lane(s))"
        if self.cached:
            head += f", cached choice (measured {chosen['measured_us']} us in an earlier process)"
        else:
            head += f", measured fastest ({self.rounds} round(s), {self.replays} replays)"
        parts = []
        for c in self.candidates:
            if c["measured_us"] is None:
                parts.append(f"{c['name']} {c['lanes']} lane(s): estimate {c['estimate_us']} us, "
                             f"not measured ({c.get('note') or 'cached choice'})")
            else:
                parts.append(f"{c['name']} {c['lanes']} lane(s): estimate {c['estimate_us']} us, "
                             f"measured {c['measured_us']} us{workspace_text(c.get('workspace_mib'))}")
        line = head + "; " + "; ".join(parts)
        if self.scale is not None:
            line += f"; cost model scale (one lane, measured/estimate) {self.scale:.2f}"
        if self.unsteady:
            line += f"; unsteady timings ({self.unsteady_text()}): not cached"
        return line

    def unsteady_text(self) -> str:
        """Each unsteady candidate's median against its fastest sample."""
        by_name = {c["name"]: c for c in self.candidates}
        return "; ".join(f"{n}: median {by_name[n]['measured_us']} us, fastest {by_name[n].get('fastest_us')} us"
                         for n in self.unsteady if n in by_name)


def append_record(dump_dir: str | None, record: PickRecord) -> None:
    """Adds ``record`` to the graph's :data:`PICKS_FILE` in ``dump_dir`` (one entry per shape)."""
    if dump_dir is None:
        return
    path = os.path.join(dump_dir, PICKS_FILE)
    try:
        entries = load_records(dump_dir)
    except (OSError, ValueError):
        entries = []
    entries.append(record.to_json())
    try:
        os.makedirs(dump_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"picks": entries}, f, indent=1)
    except OSError as e:
        files.warn_once(f"dump:{path}", "capturepass: could not write %s: %s", path, e)


def load_records(folder: str | None) -> list[dict[str, Any]]:
    """The entries of ``folder``'s :data:`PICKS_FILE` (``[]`` when there is none).

    Raises:
        ValueError: the file is not a ``{"picks": [...]}`` document.
    """
    if folder is None:
        return []
    path = os.path.join(folder, PICKS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("picks"), list):
        raise ValueError(f"{path}: expected an object with a list 'picks'")
    return [e for e in doc["picks"] if isinstance(e, dict)]


# -- the cache ---------------------------------------------------------------------------------------


def default_cache_dir() -> str:
    """``CAPTUREPASS_CACHE_DIR``, else ``capturepass/schedules`` under torch's cache directory
    (Inductor's, where its compiled kernels live), else under ``~/.cache``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return env
    base = None
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        base = cache_dir()
    except Exception:  # noqa: BLE001 - a torch without it, or a cache dir it cannot make
        base = None
    if not base:
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "capturepass", "schedules")


class ScheduleCache:
    """Measured choices on disk, one JSON file per key, written atomically.

    Args:
        directory: the folder (made when the first choice is written).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)

    @staticmethod
    def key(device: str, graph: str, shape: str) -> str:
        """The key of one choice: a digest of the device name, the graph's hash and the shapes."""
        text = json.dumps([CACHE_FORMAT, device, graph, shape])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: str) -> str:
        """The file of ``key``."""
        return os.path.join(self.directory, f"{key}.json")

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached entry of ``key``, or ``None`` (none, or unreadable: warned once)."""
        path = self.path(key)
        entry = files.read_json(path, "capturepass: the schedule cache file %s cannot be read (%s: %s); "
                                      "measuring the candidates again")
        if entry is None:
            return None
        if not isinstance(entry, dict) or entry.get("format") != CACHE_FORMAT or entry.get("key") != key \
                or not isinstance(entry.get("choice"), str) or not isinstance(entry.get("record"), dict):
            files.warn_once(f"read:{path}", "capturepass: the schedule cache file %s is not a cached choice; "
                       "measuring the candidates again", path)
            return None
        return entry

    def put(self, key: str, record: PickRecord) -> None:
        """Writes the choice of ``key`` (a failure is warned once; the choice still holds here)."""
        self._write(key, record.choice, record.to_json())

    def _write(self, key: str, choice: str, record: dict[str, Any]) -> None:
        entry = {"format": CACHE_FORMAT, "key": key, "choice": choice, "record": record}
        files.write_json(self.path(key), entry, "capturepass: cannot write the schedule cache in %s (%s); "
                                                "the choice is not kept for other processes", indent=1)

    @staticmethod
    def graph_summary_key(device: str, graph: str) -> str:
        """The key of the choices of every shape measured of one graph (``graph``: its hash before
        its schedule, :func:`capturepass.backends.candidates.graph_key` without candidates)."""
        return ScheduleCache.key(device, graph, "*")

    def shapes(self, key: str) -> dict[str, str]:
        """The choice of each shape kept under the graph summary ``key`` (none: empty)."""
        entry = self.get(key)
        shapes = entry["record"].get("shapes") if entry is not None else None
        if not isinstance(shapes, dict):
            return {}
        return {k: v for k, v in shapes.items() if isinstance(k, str) and isinstance(v, str)}

    def add_shape(self, key: str, shape: str, choice: str) -> None:
        """Adds a shape's choice to the graph summary ``key`` (written only when it changes). Its
        ``choice`` is the one every shape made, or ``"mixed"``. Two processes adding at once may
        lose one's shape: it is measured again by the next process that meets it."""
        known = self.shapes(key)
        if known.get(shape) == choice:
            return
        shapes = {**known, shape: choice}
        common = set(shapes.values())
        self._write(key, common.pop() if len(common) == 1 else MIXED, {"shapes": shapes})
