"""What a capture baked in, checked before a replay (option ``check_replay``).

A CUDA graph replays on the addresses its capture found: its input buffers' and those of every
object its owner retains for it. :class:`Snapshot` records them once captured; a replay with
``check_replay=True`` first checks them and names the first buffer or retained object that
moved, was replaced or was resized under the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from capturepass.errors import ResourceError
from capturepass.runtime.owner import HeldStorage


def _storage_of(obj: Any) -> tuple[int, int] | None:
    if isinstance(obj, HeldStorage):
        return obj.storage.data_ptr(), obj.storage.nbytes()
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
        st = obj.untyped_storage()
        return st.data_ptr(), st.nbytes()
    return None


def _kind(obj: Any) -> str:
    return obj.kind if isinstance(obj, HeldStorage) else type(obj).__name__


@dataclasses.dataclass
class Snapshot:
    """What a capture baked in: its input buffers' addresses and the storage of every retained tensor.

    Static inputs need no entry: their addresses are part of the capture's key, so a call
    whose parameters moved never replays this capture.
    """

    buffer_ptrs: dict[int, int]
    retained: dict[int, list[tuple[int, str, tuple[int, int] | None]]]

    @classmethod
    def of(cls, cap: Any) -> "Snapshot":
        retained = {
            seg: [(id(o), _kind(o), _storage_of(o)) for o in objs]
            for seg, objs in cap.owner.retained.items()
        }
        return cls({i: b.data_ptr() for i, b in cap.inputs.items()}, retained)

    def check(self, cap: Any, args: Sequence[Any]) -> None:
        """Raises :class:`ResourceError` naming the first buffer or retained object that moved."""
        owner = cap.owner
        names = [n.name for n in cap.program.inputs]
        for i, ptr in self.buffer_ptrs.items():
            if cap.inputs[i].data_ptr() != ptr:
                raise ResourceError(
                    f"check_replay: the static buffer of input {i} (%{names[i]}) of {owner.name} moved since capture"
                )
        for seg, entries in self.retained.items():
            objs = owner.retained.get(seg, [])
            if len(objs) != len(entries):
                raise ResourceError(
                    f"check_replay: segment {seg} of {owner.name} retained {len(entries)} object(s) at capture, "
                    f"{len(objs)} now"
                )
            for k, (obj, (oid, tname, storage)) in enumerate(zip(objs, entries)):
                if id(obj) != oid:
                    raise ResourceError(
                        f"check_replay: retained object {k} ({tname}) of segment {seg} of {owner.name} "
                        "was replaced since capture"
                    )
                if _storage_of(obj) != storage:
                    raise ResourceError(
                        f"check_replay: retained {tname} {k} of segment {seg} of {owner.name} changed storage "
                        f"since capture ({storage} -> {_storage_of(obj)}: resized or set_ to other memory); "
                        "the graph still uses the old address"
                    )
