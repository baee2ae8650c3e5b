"""Captured replays of a zoo model compiled with its lanes inline, against eager (needs CUDA).

Reports, per call, the largest difference from eager, which outputs were off, how many fused
segments the compile kept (a segment whose generated code fails the lane checks keeps its
lane regions) and whether any parameter changed:

    python bench/inline_capture_check.py qwen3 default  # the measured choice
    python bench/inline_capture_check.py mistral model --code DIR  # pick="model"; Inductor's code in DIR
    variants: default, model, breakable, aux1 (one side lane), lanes (the region route)

Seen on the H200 (torch 2.11), before three causes were found (docs/one_compile.md): Qwen3
wrong on the first replay, Mistral on every replay. Since: Qwen3, Mistral, Gemma2, Llama,
Qwen2-MoE, Phi equal to eager on every replay.
"""

from __future__ import annotations

import argparse
import json
import os

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


def _save_codes(directory: str) -> None:
    """Writes the output code of every Inductor compile in this process into ``directory``."""
    from torch._inductor.graph import GraphLowering

    os.makedirs(directory, exist_ok=True)
    prev = GraphLowering.save_output_code
    count = iter(range(10**6))

    def save(code: str) -> None:
        with open(os.path.join(directory, f"code{next(count):03d}.py"), "w") as f:
            f.write(code)
        if prev is not None:
            prev(code)

    GraphLowering.save_output_code = save


def main(name: str, variant: str, seeds: tuple[int, ...] = (1, 2, 3, 4), code_dir: str | None = None) -> dict:
    register()
    if code_dir is not None:
        _save_codes(code_dir)
    torch.backends.cuda.matmul.allow_tf32 = False
    model, make = zoo.build(name, device="cuda")
    params = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model, backend="capturepass", options=VARIANTS[variant])
    diffs, wrong = [], []
    with torch.no_grad():
        for seed in seeds:
            want = zoo.output_tensors(model(**make(seed)))
            got = zoo.output_tensors(compiled(**make(seed)))
            per = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}
            diffs.append(max(per.values()))
            wrong.append(sorted(k for k, d in per.items() if d > 1e-3))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, params[k])]
    fused = sum(1 for g in driver.last_compiled() if g.program is not None
                for r in g.program.regions if r.inline is not None)
    return {"model": name, "variant": variant, "max_abs_diff_per_call": diffs, "outputs_off_per_call": wrong,
            "fused_segments": fused, "changed_params": changed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("variant", nargs="?", default="default", choices=sorted(VARIANTS))
    parser.add_argument("--code", help="write every Inductor output code of the run into this folder")
    args = parser.parse_args()
    print(json.dumps(main(args.model, args.variant, code_dir=args.code)))
