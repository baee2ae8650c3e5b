"""``capturepass show DIR``: read back what a compile did, from its dump directory.

The counts are derived by hand for a two-branch model whose left branch is
hinted onto lane "aux", compiled with ``policy="hints"`` and
``cudagraphs="monolithic"`` (on the host, capture is bookkeeping only):

- lanes 2: ``main`` and ``aux``;
- records 2, waits 2: the fork (main records at the segment start, aux waits
  before its first node) and the join (aux records after ``relu``, main waits
  before ``add``);
- leases 2: a fork event and a join event never share a lease;
- retained 4: the one captured segment retains the static inputs it reads,
  the weights and biases of both linear layers;
- segments 1, breaks 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import capturepass
from capturepass import cli

EXPECTED = {"lanes": 2, "records": 2, "waits": 2, "leases": 2, "retained": 4, "segments": 1, "breaks": []}


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with capturepass.lane("aux"):
            h = torch.relu(self.a(x))
        return h + torch.tanh(self.b(x))


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    torch._dynamo.reset()
    root = tmp_path_factory.mktemp("dump")
    torch.manual_seed(0)
    model = TwoBranch()
    options = {"inner": "eager", "policy": "hints", "cudagraphs": "monolithic", "dump_dir": str(root)}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="capturepass", options=options)(x), model(x))
    torch._dynamo.reset()
    return str(root)


def test_show_prints_what_the_compile_did(dump_dir, capsys):
    assert cli.main(["show", dump_dir]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    (graph_dir,) = os.listdir(dump_dir)
    assert lines[0] == f"graph {graph_dir} (inference, owner g0, cudagraphs=monolithic)"
    assert lines[1] == "  lanes 2: s0=main s1=aux"
    assert lines[2] == "  records 2, waits 2, leases 2, releases 0, retained 4, segments 1, breaks 0"
    waits = [line for line in lines if line.startswith("  wait ")]
    assert len(waits) == 2
    assert waits[0].startswith("  wait %") and " on s1 for e0 (fork, lease l0): fork k0" in waits[0]
    assert " on s0 for e1 (join, lease l1): %relu->%add" in waits[1]
    assert lines[-1] == "total: lanes 2, records 2, waits 2, leases 2, retained 4, segments 1, breaks 0"


def test_show_json_has_the_exact_counts(dump_dir, capsys):
    assert cli.main(["show", dump_dir, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(cli.SUMMARY_KEYS) <= set(summary)
    assert {k: summary[k] for k in cli.SUMMARY_KEYS} == EXPECTED
    (graph,) = summary["graphs"]
    assert {k: graph[k] for k in cli.SUMMARY_KEYS} == EXPECTED
    assert graph["lane_names"] == ["main", "aux"]
    assert graph["graph"] == "inference" and graph["cudagraphs"] == "monolithic"
    assert [(w["lane"], w["role"], w["why"]) for w in graph["wait_reasons"]] == [
        (1, "fork", "fork k0"),
        (0, "join", "%relu->%add"),
    ]


def test_show_one_graph_folder(dump_dir, capsys):
    (graph_dir,) = os.listdir(dump_dir)
    assert cli.main(["show", os.path.join(dump_dir, graph_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {k: summary[k] for k in cli.SUMMARY_KEYS} == EXPECTED


def _run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "capturepass", *args], capture_output=True, text=True, timeout=300
    )


def test_python_dash_m_capturepass_show(dump_dir, capsys):
    proc = _run_module("show", dump_dir)
    assert proc.returncode == 0, proc.stderr
    assert cli.main(["show", dump_dir]) == 0
    assert proc.stdout == capsys.readouterr().out
    assert proc.stdout.rstrip().endswith(
        "total: lanes 2, records 2, waits 2, leases 2, retained 4, segments 1, breaks 0"
    )


def test_missing_directory_exits_2_with_a_message(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert cli.main(["show", missing]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("capturepass show: ")
    assert repr(missing) in captured.err

    proc = _run_module("show", missing, "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "capturepass show: " in proc.stderr and repr(missing) in proc.stderr


def test_directory_without_a_dump_exits_2(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path)]) == 2
    assert "no capturepass dump" in capsys.readouterr().err


def test_corrupt_graph_json_exits_2(tmp_path, capsys):
    (tmp_path / "graph.json").write_text("{not json")
    assert cli.main(["show", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("capturepass show: ")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["show"])
    assert info.value.code == 2


def test_show_lists_external_streams_and_their_joins(tmp_path, capsys):
    torch._dynamo.reset()
    model = TwoBranch()
    options = {"inner": "eager", "policy": "hints", "cudagraphs": "monolithic", "dump_dir": str(tmp_path),
               "external_streams": {"offload": "before", "comm": "both"}}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="capturepass", options=options)(x), model(x))
    torch._dynamo.reset()
    assert cli.main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  external stream comm (both): 2 join(s)\n" in out
    assert "  external stream offload (before): 1 join(s)\n" in out
    assert cli.main(["show", str(tmp_path), "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["graphs"]
    assert graph["external"] == [{"name": "comm", "relation": "both", "joins": 2},
                                 {"name": "offload", "relation": "before", "joins": 1}]
