"""Decode attention beside a sparse-attention indexer, compiled by capturepass with no stream code.

Run: ``python examples/sparse_attention_indexer.py [--device cuda] [--inner eager] [--dump DIR] [--html OUT]``

The indexer (score every cache position, keep the top-k, pool what they hold)
does not depend on the attention over the KV cache, so capturepass puts the two
on separate lanes (CUDA streams on a GPU) and joins them where their results
meet. The script prints what capturepass did, checks the result against eager,
and can write the schedule as an HTML timeline.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from capturepass.show import page as schedule_page
from capturepass.show import summarize_dir
from capturepass.testing.models import AttnIndexer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--dump", default=None, help="dump directory (default: a temporary one)")
    parser.add_argument("--html", default=None, help="also write the schedule as an HTML timeline")
    parser.add_argument("--small", action="store_true", help="small sizes even on a GPU")
    args = parser.parse_args()

    torch.manual_seed(0)
    big = args.device == "cuda" and not args.small
    sizes = (32, 32, 4096, 128, 4096, 4, 64, 512) if big else ()
    model = AttnIndexer(*sizes, device=args.device, dtype=torch.bfloat16 if big else torch.float32)
    q, x = model.example_inputs()
    dump = args.dump or tempfile.mkdtemp(prefix="capturepass-")
    compiled = torch.compile(model, backend="capturepass", options={"dump_dir": dump, "inner": args.inner})
    tol = dict(atol=3e-2, rtol=3e-2) if big else dict(atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, x), model(q, x), **tol)
        q2, x2 = model.example_inputs()
        torch.testing.assert_close(compiled(q2, x2), model(q2, x2), **tol)
    print(summarize_dir(dump))
    print(f"result equals eager on {args.device} (two calls, new input values): OK")
    if args.html:
        schedule_page.write_html(dump, args.html)
        print(f"schedule timeline: {args.html}")
    print(f"annotated IR per pass: {dump}")


if __name__ == "__main__":
    main()
