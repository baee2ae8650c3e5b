"""``scripts/static_generations.py``'s switches reach the mechanisms they name.

The script runs on a GPU only; its ``--without`` switches patch the capture path's module
attributes, which a rename would silently leave unpatched (the diagnosis then compares a
variant with itself). Each switch is checked in a fresh process against the attribute it
must change, and an unknown name is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, "scripts")
    import static_generations
    from capturepass.runtime import capture, lifetime, outputs, program, replay
    before = (program._weak_args, replay.Capture._lets_go, capture.POOL_WARM_UP_UNSUPPORTED,
              outputs.UNSUPPORTED, capture.clear_cublas_workspaces, lifetime.watch, lifetime.watch_capture)
    static_generations._without(sys.argv[1].split(","))
    run = object()
    print(program._weak_args(run, None, torch.device("cuda", 0)) is run, replay.Capture._lets_go(None) is False,
          capture.POOL_WARM_UP_UNSUPPORTED is not None, outputs.supported() is False,
          capture.clear_cublas_workspaces is not before[4],
          lifetime.watch is not before[5] and lifetime.watch_capture is not before[6],
          outputs.gc is static_generations._HEAP and static_generations._HEAP.search is False)
""")


def _run(names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK, names], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_every_switch_turns_its_mechanism_off():
    done = _run("weak-args,let-go,pool-routing,aliases,cublas-clears,finalizers,heap-search")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"] * 7


def test_one_switch_leaves_the_others_on():
    done = _run("let-go")
    assert done.returncode == 0, done.stderr
    # On a torch without CUDA the pool routing and the aliases are off already (no such calls).
    weak, let_go, _, _, clears, finalizers, heap = done.stdout.split()
    assert (weak, let_go, clears, finalizers, heap) == ("False", "True", "False", "False", "False")


def test_an_unknown_switch_is_refused_by_name():
    done = _run("let-go,weak-refs")
    assert done.returncode != 0
    assert "--without weak-refs: not one of weak-args, let-go, pool-routing, aliases, cublas-clears, finalizers, heap-search" in done.stderr
