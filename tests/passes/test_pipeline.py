"""The pass manager: named sub-pipelines, their checks, disabling by name, instruments, errors that
name the pass."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import capturepass
from capturepass.backends.compile import compile_graph
from capturepass.errors import PassError, PipelineError
from capturepass.ir import meta
from capturepass.ir.meta import Property
from capturepass.passes import pipeline
from capturepass.passes.base import Pass, PassContext
from capturepass.passes.instruments import PassInstrument
from tests.helpers import aten_graph, context
from tests.passes.cases import CASES


def _graph():
    case = CASES["fork_join"]
    return case.trace(), [n.meta.get("val") for n in case.trace().graph.nodes if n.op == "placeholder"]


def test_sub_pipelines_are_named_lists_of_the_one_pipeline():
    assert [c.name for c in pipeline.FRONT] == ["absorb_streams"]
    assert [c.name for c in pipeline.ATEN][-2:] == ["verify", "emit"]
    assert pipeline.ANALYSIS == pipeline.ATEN[:-1]
    assert pipeline.FRONT + pipeline.ATEN == pipeline.PIPELINE


def test_a_pass_whose_requirement_nothing_ensures_is_refused():
    with pytest.raises(PipelineError, match=r"pass insert_syncs requires \['lanes'\]"):
        pipeline.default_pipeline(passes=[cls for cls in pipeline.ATEN if cls.name != "assign_streams"])


def test_disable_option_leaves_a_pass_out_or_names_who_needs_it():
    gm, vals = _graph()
    compiled = compile_graph(gm, vals, {"inner": "eager", "policy": "hints", "disable": ["verify", "emit"]}, record=False)
    assert "verify" not in compiled.timings and "emit" not in compiled.timings and compiled.plan is None
    assert Property.VERIFIED not in meta.graph_info(gm).properties
    gm, vals = _graph()
    with pytest.raises(PipelineError, match=r"pass lease_events requires \['synced'\]"):
        compile_graph(gm, vals, {"inner": "eager", "disable": ["insert_syncs"]}, record=False)
    with pytest.raises(capturepass.OptionError, match="option 'disable' must be a list of pass names"):
        compile_graph(gm, vals, {"disable": "verify"}, record=False)


class _Recorder(PassInstrument):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def enter_pipeline(self, gm, ctx):
        self.calls.append("enter")

    def should_run(self, p, gm, ctx):
        return p.name != "annotate_capabilities"

    def run_before_pass(self, p, gm, ctx):
        self.calls.append(f"before {p.name}")

    def run_after_pass(self, p, gm, ctx):
        self.calls.append(f"after {p.name} {sorted(meta.graph_info(gm).properties)[-1:]}")

    def exit_pipeline(self, gm, ctx):
        self.calls.append("exit")


def test_instruments_wrap_every_pass_in_order_and_can_skip_one():
    gm, _ = _graph()
    rec = _Recorder()
    passes = pipeline.default_pipeline(passes=[c for c in pipeline.ATEN if c.name in ("read_hints", "annotate_capabilities")])
    pipeline.run_pipeline(passes, gm, context(policy="hints"), [rec])
    assert rec.calls == ["enter", "before read_hints", "after read_hints ['hints']", "exit"]


class _Broken(Pass):
    name = "broken"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        {}["missing"]


def test_an_exception_of_a_pass_names_the_pass():
    gm, _ = _graph()
    with pytest.raises(PassError, match=r"capturepass pass broken failed: KeyError: 'missing'") as info:
        pipeline.run_pipeline([_Broken()], gm, context())
    assert info.value.pass_name == "broken" and isinstance(info.value.__cause__, KeyError)


def test_passes_do_not_log_decisions_the_instrument_does(caplog):
    def fn(x):
        with capturepass.lane("a"):
            y = x.sin()
        with capturepass.lane("b"):
            z = x.cos()
        return y + z

    gm = aten_graph(fn, torch.randn(4, 4))
    with caplog.at_level("INFO", logger="capturepass"):
        compiled = compile_graph(gm, [torch.randn(4, 4)], {"inner": "eager", "policy": "hints", "max_aux_lanes": 1},
                                 record=False)
    folds = [r for r in caplog.records if "hinted lane(s) b run on the main lane" in r.getMessage()]
    # Once, at WARNING, from the instrument (naming graph, owner and pass): never again from the pass.
    owner = meta.graph_info(compiled.graph).owner
    assert [(r.levelname, r.getMessage()) for r in folds] == [
        ("WARNING", f"capturepass: inference graph {owner}: assign_streams: max_aux_lanes=1: hinted lane(s) b run "
                    "on the main lane")
    ]
