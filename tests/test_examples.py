"""Every example runs on the CPU, prints what capturepass did, and checks its result against eager.

Each runs as a subprocess with ``--inner eager`` and its small sizes; the
examples assert equality with eager themselves (a failed check exits non-zero).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "CAPTUREPASS_DUMP_DIR")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), "--device", "cpu", "--inner", "eager", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _torchrun(name: str, *args: str, nproc: int = 2) -> str:
    """Runs an example on ``nproc`` CPU processes with torchrun (``--standalone``: a free port)."""
    from capturepass.testing import parallel

    reason = parallel.gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "CAPTUREPASS_DUMP_DIR")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         os.path.join(ROOT, "examples", name), "--device", "cpu", "--inner", "eager", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _totals(out: str) -> list[dict[str, int]]:
    return [
        {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line)}
        for line in out.splitlines() if line.startswith("total: ")
    ]


def test_moe_shared_expert(tmp_path):
    trace = tmp_path / "trace.json"
    out = _run("moe_shared_expert.py", "--dump", str(tmp_path / "dump"), "--trace", str(trace))
    (total,) = _totals(out)
    assert total["lanes"] == 3 and total["waits"] > 0 and total["segments"] == 1
    assert "result equals eager on cpu (two calls, new input values): OK" in out
    # Without CUDA, --trace writes the cost-model schedule and says so.
    assert f"trace {trace}: cost-model estimates" in out and "needs a CUDA device" in out
    assert json.loads(trace.read_text())["otherData"]["times"] == "estimated (nominal device)"


def test_sparse_attention_indexer(tmp_path):
    page = tmp_path / "schedule.html"
    out = _run("sparse_attention_indexer.py", "--dump", str(tmp_path / "dump"), "--html", str(page))
    (total,) = _totals(out)
    assert total["lanes"] >= 2 and total["waits"] >= 2
    assert "result equals eager on cpu (two calls, new input values): OK" in out
    models = re.findall(r'<script type="application/json" class="schedule-model">(.*?)</script>', page.read_text())
    assert [len(json.loads(m)["lanes"]) for m in models] == [total["lanes"]]


def test_speculative_target_draft(tmp_path):
    out = _run("speculative_target_draft.py", "--dump", str(tmp_path))
    assert len(_totals(out)) == 2
    lines = [line for line in out.splitlines() if line.startswith("owners of the ")]
    draft, target = (set(re.findall(r"'([^']+)'", line)) for line in lines)
    assert draft and target and not draft & target
    # Two graph owners, one per dump, and each model's runtime owners named after its graph's.
    graph_owners = re.findall(r"^graph \S+ \(inference, owner (g\d+), ", out, re.M)
    assert len(set(graph_owners)) == 2
    for line, owners, graph_owner in zip(lines, (draft, target), graph_owners):
        assert f"(graph owner {graph_owner}): " in line
        assert owners == {f"{graph_owner}.m0.eager"}
        assert f"    model {graph_owner}.m0: {graph_owner}.m0.eager (uncaptured runs, the first of f32[8,64])" in out
    assert len(re.findall(r"workspace \S+ s0 gated_mlp.up: \[0x", out)) == 2
    assert "workspaces are disjoint (on the CPU, read from the owner objects): OK" in out
    assert "results equal eager on cpu (draft and target, two steps): OK" in out


def test_custom_op_retention(tmp_path):
    out = _run("custom_op_retention.py", "--dump", str(tmp_path))
    (total,) = _totals(out)
    # The segment reads the three layers' weights and biases: six static inputs retained.
    assert total["retained"] == 6
    (owner,) = [line for line in out.splitlines() if line.startswith("owner ")]
    assert ": 6 object(s) retained: Parameter" in owner
    assert re.search(r"capturepass.retain called [1-9]\d* time\(s\) by the op .*returned True 0 time\(s\)", out)
    assert "result equals eager on cpu (three calls, new input values): OK" in out


def test_tensor_parallel_moe(tmp_path):
    out = _torchrun("tensor_parallel_moe.py", "--dump", str(tmp_path))
    # Rank 0's four graphs (two blocks, two token counts): a comm lane each, waits on it.
    (total,) = _totals(out)
    assert total["lanes"] == 4 and total["segments"] == 4 and total["waits"] > 0
    assert out.count("lane s1 comm: 4 kernel(s)") == 4
    for block in ("tp", "ep"):
        for t in (4, 32):
            # Exact against the ranks' op order redone in one process (eager kernels, gloo).
            assert re.search(rf"^{block} T={t}: max \|out - reference\| 0\.00e\+00 \(the ranks' op order, one process\), "
                             r"\S+ \(the full block\); two calls, new values: OK$", out, re.M), out
    owners = re.findall(r"^  (g\d+\.m\d+/s1): traced group '0' -> '(\w+)'$", out, re.M)
    assert len(owners) == 4 and len({name for _, name in owners}) == 4
    assert "results equal the single-process reference on cpu (2 ranks, tensor and expert parallel, " in out
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]


def test_tensor_parallel_moe_without_torchrun_says_how_to_start_it():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tensor_parallel_moe.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "tensor_parallel_moe: start it with torchrun --nproc-per-node 2 (one process per rank)"


@pytest.mark.parametrize("name", sorted(
    f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py") and f != "vllm_offline.py"
))
def test_every_example_is_tested(name):
    assert f"test_{name[:-3]}" in globals(), f"examples/{name} has no test here"


def test_engine_resources(tmp_path):
    out = _run("engine_resources.py", "--dump", str(tmp_path))
    (total,) = _totals(out)
    assert total["lanes"] == 2 and total["waits"] == 2
    (graph_dir,) = os.listdir(tmp_path)
    assert os.path.isfile(tmp_path / graph_dir / "graph.json")
    assert "  external stream offload (before): 1 join(s)" in out
    # One graph for the class (the dump's owner), two models: two owners of each kind, named after it.
    (owner,) = re.findall(r"^graph \S+ \(inference, owner (g\d+), ", out, re.M)
    assert f"profiling capture: 2 throwaway owner(s) {owner}.m0.profile, {owner}.m1.profile; " in out
    assert re.search(r"profiling capture: .* left allocated 0 B", out)
    assert f"channels released with them: {owner}.m0.profile/s0, {owner}.m1.profile/s0; live now: none" in out
    assert "channels: 3 live, one per owner and lane:" in out and "  eager/s0: 3 call(s)" in out
    assert f"  {owner}.m0.eager/s0: 3 call(s)" in out and f"  {owner}.m1.eager/s0: 3 call(s)" in out
    assert "external stream joins in the dump: 1" in out
    assert "result equals eager on cpu (target and draft interleaved, weights from the offload stream): OK" in out


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")))
def test_every_example_takes_device_and_dump(name):
    """The same two flags everywhere (vllm_offline.py imports vLLM only after parsing them)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"--device\b", proc.stdout) and re.search(r"--dump\b", proc.stdout), proc.stdout


def test_vllm_example_without_vllm_says_which_venv(tmp_path):
    # Asked in a fresh interpreter: here tests/ is on sys.path, and tests/vllm is a package.
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm') is None)"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    if probe.stdout.strip() != "True":
        pytest.skip("vllm is installed here")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm_offline.py"), "--device", "cpu",
                           "--dump", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("vllm_offline: No module named 'vllm': run it with the venv that has vLLM "
                                   "(bash scripts/test_vllm.sh makes .venv-vllm)")
