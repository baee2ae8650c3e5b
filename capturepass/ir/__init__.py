"""The annotated IR: typed metadata on FX graphs, its dump, analyses and verifier.

Design note. capturepass does not invent a new IR: it annotates the functional
ATen FX graph that AOT autograd produces. Every capturepass fact about a node
(its lane, its capability answer and cost, the event it records or waits for,
its lease, owner and segment, and the pass that created or changed it) lives in
one frozen record under ``node.meta["capturepass"]`` (``meta.py``); nothing
outside this package reads or writes that key. Sync, release and retention
points are real nodes calling ``capturepass::`` ops (``ops.py``), placed in
program order, so the graph itself is the schedule. ``printer.py`` renders the
deterministic one-line-per-node dump and ``graph.json``, which ``graph_json.py``
reads back, validated; ``verify.py`` re-derives happens-before from the sync
nodes present and checks every invariant. ``hops.py`` knows higher-order ops:
their subgraph modules, and the op a functionalization or effect wrapper calls.
"""
