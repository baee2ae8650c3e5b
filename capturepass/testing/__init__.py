"""Reference models and tools for testing capturepass and code built on it.

``models`` holds the two reference workloads of the field (a MoE block with a
shared expert, decode attention beside a sparse-attention indexer) at any size,
written as plain PyTorch with no stream code, for examples, tests and
benchmarks.
"""
