"""How much of Inductor's fusion a graph's lanes cost: the zoo's models compiled on the CPU with
one compile per capture segment (``regions="segments"``), the default schedule against one lane
(``policy="off"``), counting in the generated code the fused kernels, the library calls (matrix
products), the lane sync points (``capturepass::inline_step``) and the buffers allocated.

Lanes are worth their syncs only where the work they overlap is large: where the schedule cuts
chains of pointwise ops that Inductor fuses into one kernel on one lane (a rotary embedding's
products and sums spread over lanes), each piece launches a kernel of its own and the kernel count
grows. The host's generated code shows the same cuts the GPU's does (the lanes are planned on the
graph, not on the device).

    python3 scripts/fusion_split.py --models llama,qwen2_moe
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VARIANTS = {"default": {"regions": "segments"}, "one lane": {"regions": "segments", "policy": "off"}}


def counts(code: str) -> dict[str, int]:
    """Fused kernels, library calls, sync points and buffers in the ``call`` of generated code."""
    body = code[code.index("def call("):] if "def call(" in code else code
    return {
        "kernels": len(re.findall(r"^\s+(?:cpp_fused|triton_\w+_fused)\w*[.(]", body, re.M)),
        "library": len(re.findall(r"^\s+extern_kernels\.\w+\(", body, re.M)),
        "syncs": len(re.findall(r"torch\.ops\.capturepass\.inline_step\.default\(", body)),
        "buffers": len(re.findall(r"= empty_strided_\w+\(", body)),
    }


def measure(name: str) -> dict[str, dict[str, int]]:
    """:func:`counts` of the zoo model ``name`` (decode [8, 1]) for each of :data:`VARIANTS`,
    with the lanes of its graph."""
    import torch

    import capturepass  # noqa: F401 - registers the backend where no entry point is installed
    from capturepass.backends.compile import last_compiled
    from capturepass.ir import meta
    from capturepass.testing import zoo

    model, _ = zoo.build(name)
    model.eval()
    ids = torch.randint(0, zoo.VOCAB, (8, 1), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        for label, opts in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="capturepass", options=opts)
            _, codes = torch._inductor.utils.run_and_get_code(compiled, input_ids=ids, use_cache=False)
            found = {k: 0 for k in ("kernels", "library", "syncs", "buffers")}
            for code in codes:
                for k, v in counts(code).items():
                    found[k] += v
            found["lanes"] = len(meta.graph_info(last_compiled()[-1].graph).lanes)
            out[label] = found
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,qwen2_moe", help="comma-separated zoo names")
    args = p.parse_args()
    print("| model | schedule | lanes | fused kernels | library calls | sync points | buffers |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for label, c in measure(name).items():
            print(f"| {name} | {label} | {c['lanes']} | {c['kernels']} | {c['library']} | {c['syncs']} | {c['buffers']} |")


if __name__ == "__main__":
    main()
