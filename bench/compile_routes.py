"""Compile time of one zoo model through one route, in a fresh process and a fresh Inductor cache.

Routes: ``inductor`` (``backend="inductor"``), and capturepass with ``regions`` set to
``lanes`` (one Inductor compile per lane region, as a GPU compiles today) or ``segments``
(one per capture segment, lanes inline). On the host the lanes run in program order, but the
regions and their compiles are those a GPU would make from the host's schedule.

Prints the seconds of the first call (compile included) and the number of Inductor compiles.
Compare routes with ``/usr/bin/time`` or a benchmark harness over several processes:

    python bench/compile_routes.py gpt2 lanes
    python bench/compile_routes.py gpt2 segments
    python bench/compile_routes.py gpt2 inductor
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

import torch  # noqa: E402
import torch._inductor.graph  # noqa: E402

from capturepass.backends.dynamo import register  # noqa: E402
from capturepass.testing import zoo  # noqa: E402


def main(name: str, route: str) -> dict:
    register()
    model, make = zoo.build(name)
    inputs = make(1)
    if route == "inductor":
        compiled = torch.compile(model, backend="inductor")
    else:
        compiled = torch.compile(model, backend="capturepass", options={"regions": route})
    compiles = []
    real = torch._inductor.graph.GraphLowering.compile_to_module

    def counted(self, *a, **k):
        compiles.append(1)
        return real(self, *a, **k)

    torch._inductor.graph.GraphLowering.compile_to_module = counted
    start = time.perf_counter()
    with torch.no_grad():
        compiled(**inputs)
    return {"model": name, "route": route, "first_call_s": round(time.perf_counter() - start, 2),
            "inductor_compiles": len(compiles)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
