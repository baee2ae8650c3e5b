"""Tensor- and expert-parallel MoE blocks on two processes, compiled by capturepass with no stream code.

Run: ``torchrun --nproc-per-node 2 examples/tensor_parallel_moe.py [--device cpu|cuda] [--dump DIR]
[--inner eager] [--tokens T ...] [--cudagraphs monolithic|breakable|none]``

``--device cpu`` joins the processes with gloo, ``--device cuda`` with NCCL (one GPU per
process, bf16 and the sizes of a 4096-wide model). Two blocks split one MoE block (a shared
expert beside 8 routed experts, top-2) over the ranks:

- tensor parallel: the shared expert column- then row-parallel, summed by an all-reduce; the
  routed experts 4 per rank, summed by their own all-reduce;
- expert parallel: the shared expert replicated, each rank's tokens dispatched to the routed
  experts (4 per rank) and combined by two fixed-capacity ``all_to_all_single``.

capturepass puts each collective on a comm lane (its own CUDA stream on a GPU), starts it as
soon as its input is ready, makes its ``wait_tensor`` the dependency, and runs the
independent compute (the other branch, the shared expert) on other lanes meanwhile. Each
compiled graph posts on a process group of its own (its owner's communicator), never on the
one it was traced with. Each block runs a decode-sized and a prefill-sized token count, twice
each with new values (on a GPU the second call replays the captured graph), and every result
is checked against a single-process reference computed from the same weights: the ranks'
computation redone in one process in their op order, and the full block. The script prints
both differences, the lanes and waits of each graph, and each owner's communicators.
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile

# NVLink multicast (NVLS) is not needed between two GPUs; it stays off unless the environment
# turns it on.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                        help="cpu: gloo; cuda: NCCL, one GPU per process")
    parser.add_argument("--dump", default=None, help="dump directory (default: a temporary one); rank r dumps to DIR/rank<r>")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="token counts per rank (default: 16 256 on a GPU, 4 32 on the CPU: decode and prefill)")
    parser.add_argument("--cudagraphs", default=None, choices=["monolithic", "breakable", "none"],
                        help="capture mode (default: monolithic on CUDA, none on the CPU)")
    parser.add_argument("--small", action="store_true", help="the small float32 block even on a GPU")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("tensor_parallel_moe: start it with torchrun --nproc-per-node 2 (one process per rank)")

    import torch.distributed as dist

    import capturepass
    from capturepass.runtime import comms
    from capturepass.show import summarize_dir
    from capturepass.testing import parallel
    from capturepass.testing.models import MoEBlock

    cuda = args.device == "cuda"
    if cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        # Bound to its GPU where torch can (NCCL guesses it from the rank otherwise).
        bound = {"device_id": local} if "device_id" in inspect.signature(dist.init_process_group).parameters else {}
        dist.init_process_group("nccl", **bound)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # the same kernels in the ranks and in the references

    big = cuda and not args.small
    sizes = {"d": 4096, "shared": 11008, "experts": 8, "expert_width": 1408, "topk": 2} if big else parallel.SIZES
    dtype = torch.bfloat16 if big else torch.float32
    tokens = args.tokens or ([16, 256] if cuda else [4, 32])
    torch.manual_seed(0)  # the same weights on every rank
    full = MoEBlock(**sizes, device=device, dtype=dtype)
    dump = args.dump or tempfile.mkdtemp(prefix="capturepass-")
    exact = not cuda and args.inner == "eager"  # eager ATen kernels, one thread, gloo: to the last bit
    # bf16 results of a 4096-wide block round differently in every op order: 2e-2 as the other
    # examples' bf16 checks; float32 with Inductor's own kernels: torch's float32 tolerance.
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else parallel.FLOAT32_TOLERANCE

    blocks = {"tp": parallel.TensorParallelMoE(full, rank, world), "ep": parallel.ExpertParallelMoE(full, rank, world)}
    # Every rank's modules, for the references computed in this process.
    shards = {"tp": [parallel.TensorParallelMoE(full, r, world) for r in range(world)],
              "ep": [parallel.ExpertParallelMoE(full, r, world) for r in range(world)]}
    lines = []
    for name, block in blocks.items():
        options = {"dump_dir": os.path.join(dump, f"rank{rank}", name), "inner": args.inner}
        if args.cudagraphs is not None:
            options["cudagraphs"] = args.cudagraphs
        compiled = torch.compile(block, backend="capturepass", options=options, dynamic=False)
        for t in tokens:
            worst = [0.0, 0.0]
            for call in range(2):
                xs = [x.to(device=device, dtype=dtype) for x in parallel.tokens_of(name, call, t, world, sizes["d"])]
                with torch.no_grad():
                    out = compiled(xs[rank])
                    if name == "ep":
                        same = parallel.expert_parallel_reference(full, xs, world, shards[name])[rank]
                    else:
                        same = parallel.tensor_parallel_reference(full, xs[rank], world, shards[name])
                    ref = full(xs[rank])
                torch.testing.assert_close(out, same, **({"atol": 0, "rtol": 0} if exact else tol))
                torch.testing.assert_close(out, ref, **tol)
                worst = [max(worst[0], float((out - same).abs().max())), max(worst[1], float((out - ref).abs().max()))]
            lines.append(f"{name} T={t}: max |out - reference| {worst[0]:.2e} (the ranks' op order, one process), "
                         f"{worst[1]:.2e} (the full block); two calls, new values: OK")

    owners = comms.communicators()
    dist.barrier()
    if rank == 0:
        print(summarize_dir(os.path.join(dump, "rank0")))
        for line in lines:
            print(line)
        print(f"communicators of rank 0, one process group per model instance and lane ({len(owners)} of them):")
        for key, groups in owners.items():
            print(f"  {key}: " + ", ".join(f"traced group {g!r} -> {name!r}" for g, name in groups.items()))
        print(f"results equal the single-process reference on {args.device} ({world} ranks, tensor and expert "
              f"parallel, {len(tokens)} token counts, two calls each): OK")
        print(f"annotated IR per pass: {dump}/rank<r>/<block>")
    # Every rank releases its compiled blocks, in one order, before the process group goes:
    # NCCL destroys a communicator only once the CUDA graphs that captured its collectives are gone.
    for block in blocks.values():
        capturepass.release(block)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
