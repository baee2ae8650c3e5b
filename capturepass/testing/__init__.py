"""Reference models and tools for testing capturepass and code built on it.

``models`` holds the two reference workloads of the field (a MoE block with a
shared expert, decode attention beside a sparse-attention indexer) at any size,
written as plain PyTorch with no stream code, for examples, tests and
benchmarks.

``host_graphs`` stands in for CUDA graphs on a machine without CUDA, so that a
capture's real replay path (buffers, output aliases and their rescue, inputs read in place)
runs on the host.

``simulate`` runs a compiled graph's lanes in seeded adversarial interleavings
with an allocator that reuses and poisons freed blocks, and checks
happens-before; ``mutate`` removes one inserted wait, record, release,
retention or lease scope at a time and scores the verifier and the simulator
(see RELIABILITY.md).
"""
