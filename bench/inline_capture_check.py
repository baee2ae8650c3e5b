"""Captured replays of a zoo model compiled with its lanes inline, against eager (needs CUDA).

A graph captured with more than one lane keeps its lane regions under ``regions="segments"``
(``CAPTURED_INLINE_LANES`` in ``capturepass/backends/compile.py``) because its captured replays
were wrong on two zoo models. This script lifts that gate in its own process and reports, per
call, the largest difference from eager and whether any parameter changed:

    python bench/inline_capture_check.py qwen3 model    # pick="model"
    python bench/inline_capture_check.py qwen3 default  # the measured choice
    variants: default, model, breakable, aux1 (one side lane), lanes (the region route)

Seen on the H200 (torch 2.11): Qwen3 wrong on the first replay only with the measured choice
or one side lane, right with ``pick="model"`` and two; Mistral wrong on every replay with
``pick="model"``; right with ``cudagraphs="breakable"``, uncaptured and with lane regions.
"""

from __future__ import annotations

import json
import sys

import torch

import capturepass.backends.compile as driver
from capturepass.backends.dynamo import register
from capturepass.testing import zoo

VARIANTS = {
    "default": {"regions": "segments"},
    "model": {"regions": "segments", "pick": "model"},
    "breakable": {"regions": "segments", "pick": "model", "cudagraphs": "breakable"},
    "aux1": {"regions": "segments", "pick": "model", "max_aux_lanes": 1},
    "lanes": {"regions": "lanes", "pick": "model"},
}


def main(name: str, variant: str, seeds: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    register()
    driver.CAPTURED_INLINE_LANES = True
    torch.backends.cuda.matmul.allow_tf32 = False
    model, make = zoo.build(name, device="cuda")
    params = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model, backend="capturepass", options=VARIANTS[variant])
    diffs = []
    with torch.no_grad():
        for seed in seeds:
            want = zoo.output_tensors(model(**make(seed)))
            got = zoo.output_tensors(compiled(**make(seed)))
            diffs.append(max((got[k].float() - want[k].float()).abs().max().item() for k in want))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, params[k])]
    return {"model": name, "variant": variant, "max_abs_diff_per_call": diffs, "changed_params": changed}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "default")))
