"""Backend options: validation errors name the valid choices; the dump directory from the environment."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re

import pytest
import torch
from backends.e2e_util import new_compiles, unwrap

import capturepass
from capturepass.backends.dynamo import capturepass_backend
from capturepass.ir import meta
from capturepass.ir.options import CUDAGRAPH_MODES, DUMP_DIR_ENV, INNER_COMPILERS, POLICIES, Options
from capturepass.passes.pipeline import PIPELINE
from capturepass.runtime import files

OPTION_NAMES = ("policy", "max_aux_lanes", "inner", "cudagraphs", "dump_dir", "verify")

# (options, the words the message must contain)
BAD_OPTIONS = [
    pytest.param({"bogus": 1}, ("'bogus'",) + OPTION_NAMES, id="unknown-key"),
    pytest.param({"polcy": "off"}, ("'polcy'",) + OPTION_NAMES, id="misspelled-key"),
    pytest.param({"policy": "fast"}, ("'policy'", "'fast'") + tuple(f"'{p}'" for p in POLICIES), id="policy"),
    pytest.param({"inner": "tvm"}, ("'inner'", "'tvm'") + tuple(f"'{c}'" for c in INNER_COMPILERS), id="inner"),
    pytest.param(
        {"cudagraphs": "always"}, ("'cudagraphs'", "'always'") + tuple(f"'{m}'" for m in CUDAGRAPH_MODES),
        id="cudagraphs",
    ),
    pytest.param({"cudagraphs": True}, ("'cudagraphs'", "True", "'breakable'"), id="cudagraphs-bool"),
    pytest.param({"max_aux_lanes": -1}, ("'max_aux_lanes'", "non-negative int", "-1"), id="lanes-negative"),
    pytest.param({"max_aux_lanes": 1.5}, ("'max_aux_lanes'", "non-negative int", "1.5"), id="lanes-float"),
    pytest.param({"max_aux_lanes": "2"}, ("'max_aux_lanes'", "non-negative int", "'2'"), id="lanes-str"),
    pytest.param({"max_aux_lanes": True}, ("'max_aux_lanes'", "non-negative int", "True"), id="lanes-bool"),
    pytest.param({"verify": "yes"}, ("'verify'", "True or False"), id="verify"),
    pytest.param({"dump_dir": 3}, ("'dump_dir'", "path"), id="dump-dir"),
    pytest.param({"dump_dir": ""}, ("'dump_dir'", "empty path", "None"), id="dump-dir-empty"),
]


def _assert_message(err: BaseException, words) -> None:
    assert isinstance(err, capturepass.OptionError), repr(err)
    assert isinstance(err, capturepass.CapturePassError)
    for word in words:
        assert word in str(err), f"{word!r} not in {str(err)!r}"


@pytest.mark.parametrize("options,words", BAD_OPTIONS)
def test_bad_option_is_refused_with_the_valid_choices(options, words):
    with pytest.raises(capturepass.OptionError) as info:
        Options.from_mapping(options)
    _assert_message(info.value, words)


def _graph():
    return torch.fx.symbolic_trace(lambda x: x.sin())


@pytest.mark.parametrize("options,words", BAD_OPTIONS[:6])
def test_the_backend_refuses_bad_options_before_compiling(options, words):
    # Called directly, the backend raises OptionError itself ...
    with new_compiles() as graphs, pytest.raises(capturepass.OptionError) as info:
        capturepass_backend(_graph(), [torch.randn(3)], options=options)
    _assert_message(info.value, words)
    assert graphs == []


@pytest.mark.parametrize("options,words", [BAD_OPTIONS[0], BAD_OPTIONS[2]])
def test_torch_compile_reports_the_option_error(options, words):
    # ... and through torch.compile, Dynamo wraps it; the OptionError and its message survive.
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x.sin(), backend="capturepass", options=options)(torch.randn(3))
    _assert_message(unwrap(info.value), words)
    assert "OptionError" in str(info.value)


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs", "fast"])
def test_a_mode_other_than_reduce_overhead_is_refused(mode):
    with pytest.raises(capturepass.OptionError) as info:
        capturepass_backend(_graph(), [torch.randn(3)], mode=mode)
    _assert_message(info.value, (repr(mode), "cudagraphs", "'monolithic'", "'breakable'", "'none'", "max_autotune"))
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x.sin(), backend="capturepass", mode=mode)(torch.randn(3))
    _assert_message(unwrap(info.value), (repr(mode), "'monolithic'", "'breakable'", "'none'"))


def test_reduce_overhead_mode_compiles_with_the_default_options(caplog, monkeypatch):
    """Code written for Inductor's ``mode="reduce-overhead"`` (Hugging Face's ``CompileConfig``
    passes it by default) runs unchanged: the mode asks for what capturepass does by default."""
    monkeypatch.setattr(files, "_warned", set())
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        got = torch.compile(lambda t: (t.sin() @ t.T).relu(), backend="capturepass", mode="reduce-overhead")(x)
    torch.testing.assert_close(got, (x.sin() @ x.T).relu())
    told = [r.getMessage() for r in caplog.records if "mode='reduce-overhead'" in r.getMessage()]
    assert len(told) == 1 and "captures CUDA graphs itself" in told[0], told


@pytest.mark.skipif(importlib.util.find_spec("torch_tensorrt") is not None, reason="torch_tensorrt is installed")
def test_tensorrt_without_the_package_is_a_clear_option_error():
    assert Options.from_mapping({"inner": "tensorrt"}).inner == "tensorrt"  # a valid choice ...
    with pytest.raises(Exception) as info:  # ... that cannot run here
        torch.compile(lambda x: x.sin(), backend="capturepass", options={"inner": "tensorrt"})(torch.randn(3))
    _assert_message(unwrap(info.value), ("torch_tensorrt", "not installed", "'inductor'", "'eager'"))


def test_valid_options_are_accepted():
    opts = Options.from_mapping(
        {"policy": "hints", "max_aux_lanes": 0, "inner": "eager", "cudagraphs": "none", "verify": True}
    )
    assert (opts.policy, opts.max_aux_lanes, opts.inner, opts.cudagraphs, opts.verify) == (
        "hints", 0, "eager", "none", True
    )


@pytest.mark.parametrize("cudagraphs", ["monolithic", "breakable", None])
def test_cuda_graphs_asked_of_a_host_graph_say_it_runs_uncaptured(cudagraphs, caplog):
    import logging

    model = torch.nn.Linear(8, 8)
    options = {"inner": "eager"} if cudagraphs is None else {"inner": "eager", "cudagraphs": cudagraphs}
    with caplog.at_level(logging.INFO, logger="capturepass"), torch.no_grad():
        torch.compile(model, backend="capturepass", options=options)(torch.randn(2, 8))
    said = [r.getMessage() for r in caplog.records if "asks for CUDA graphs" in r.getMessage()]
    if cudagraphs is None:  # the default on the host: no capture asked for
        assert not said
    else:
        assert said == [f"capturepass: inference graph: cudagraphs={cudagraphs!r} asks for CUDA graphs, but its "
                        "tensors are not on a CUDA device: it runs uncaptured"], said


def _dump_files(root) -> tuple[str, list[str]]:
    (graph_dir,) = os.listdir(root)
    return graph_dir, sorted(os.listdir(os.path.join(root, graph_dir)))


def test_dump_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert Options.from_mapping({}).dump_dir == str(tmp_path)
    x = torch.randn(4, 8)
    fn = lambda x: torch.relu(x) + torch.tanh(x)  # noqa: E731
    with new_compiles() as graphs:
        out = torch.compile(fn, backend="capturepass", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, fn(x))
    assert [g.dump_dir for g in graphs] == [os.path.join(str(tmp_path), _dump_files(tmp_path)[0])]

    graph_dir, files = _dump_files(tmp_path)
    assert re.fullmatch(r"\d{3}_inference", graph_dir)
    passes = [cls.name for cls in PIPELINE]
    assert files == sorted([f"{i:03d}_{name}.txt" for i, name in enumerate(passes)] + ["graph.json", "owners.json"])
    with open(tmp_path / graph_dir / "graph.json") as f:
        doc = json.load(f)
    assert doc["graph"] == "inference" and doc["lanes"][0] == "main"
    # The runtime's owners, named after the graph owner: one model, run uncaptured on the host.
    assert doc["owner"] == str(meta.graph_info(graphs[0].graph).owner) == graphs[0].executor.graph_owner
    with open(tmp_path / graph_dir / "owners.json") as f:
        owners = json.load(f)
    assert (owners["format"], owners["graph"], owners["owner"]) == ("capturepass-owners/1", "inference", doc["owner"])
    assert owners["owners"] == [{"name": f"{doc['owner']}.m0.eager", "model": f"{doc['owner']}.m0", "role": "eager",
                                 "inputs": "f32[4,8]", "device": "cpu"}]
    assert {n["name"] for n in doc["nodes"]} >= {"relu", "tanh"}
    with open(tmp_path / graph_dir / "010_emit.txt") as f:
        text = f.read()
    assert text.startswith("# after emit") and "# outer program" in text


def test_explicit_dump_dir_wins_over_the_environment(tmp_path, monkeypatch):
    env_dir, opt_dir = tmp_path / "env", tmp_path / "opt"
    monkeypatch.setenv(DUMP_DIR_ENV, str(env_dir))
    assert Options.from_mapping({"dump_dir": str(opt_dir)}).dump_dir == str(opt_dir)
    assert Options.from_mapping({"dump_dir": None}).dump_dir is None


def test_empty_dump_dir_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """Regression: ``dump_dir=""`` wrote the dumps into the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x.sin(), backend="capturepass", options={"inner": "eager", "dump_dir": ""})(
            torch.randn(3)
        )
    _assert_message(unwrap(info.value), ("'dump_dir'", "empty path"))
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", json.dumps({"dump_dir": ""}))
    with pytest.raises(capturepass.OptionError,
                       match=re.escape("option 'dump_dir' (from CAPTUREPASS_OPTIONS) is an empty path")):
        Options.from_mapping({})
    assert os.listdir(tmp_path) == []


def test_empty_dump_dir_variable_counts_as_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DUMP_DIR_ENV, "")
    assert Options.from_mapping({}).dump_dir is None
    x = torch.randn(4)
    with new_compiles() as graphs:
        torch.testing.assert_close(torch.compile(lambda x: x.cos(), backend="capturepass",
                                                 options={"inner": "eager"})(x), x.cos())
    assert [g.dump_dir for g in graphs] == [None]
    assert os.listdir(tmp_path) == []


# -- the closest valid name; values checked before anything is compiled --------------------------


@pytest.mark.parametrize("options,message", [
    ({"polcy": "off"}, "unknown capturepass option(s) 'polcy' (did you mean 'policy'?); valid options are: "),
    ({"max_aux_lane": 1}, "'max_aux_lane' (did you mean 'max_aux_lanes'?)"),
    ({"dumpdir": "x"}, "'dumpdir' (did you mean 'dump_dir'?)"),
    ({"policy": "hint"}, "option 'policy' must be one of 'auto', 'hints', 'off'; got 'hint' (did you mean 'hints'?)"),
    ({"inner": "Inductor"}, "got 'Inductor' (did you mean 'inductor'?)"),
    ({"cudagraphs": "break"}, "got 'break' (did you mean 'breakable'?)"),
])
def test_a_misspelled_name_gets_the_closest_valid_one(options, message):
    with pytest.raises(capturepass.OptionError) as info:
        Options.from_mapping(options)
    assert message in str(info.value)


def test_nothing_close_gets_no_suggestion():
    with pytest.raises(capturepass.OptionError) as info:
        Options.from_mapping({"zzzz": 1})
    assert "did you mean" not in str(info.value) and "'zzzz'" in str(info.value)


def test_an_unknown_key_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", json.dumps({"polcy": "off"}))
    with pytest.raises(capturepass.OptionError, match=re.escape(
            "'polcy' (in CAPTUREPASS_OPTIONS) (did you mean 'policy'?)")):
        Options.from_mapping({})
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", json.dumps({"policy": "fast"}))
    with pytest.raises(capturepass.OptionError, match=re.escape("option 'policy' (from CAPTUREPASS_OPTIONS) must be")):
        Options.from_mapping({})


def test_a_dump_dir_that_is_a_file_is_refused_before_compiling(tmp_path, monkeypatch):
    path = tmp_path / "dump"
    path.write_text("not a directory")
    with new_compiles() as graphs, pytest.raises(capturepass.OptionError) as info:
        capturepass_backend(_graph(), [torch.randn(3)], options={"inner": "eager", "dump_dir": str(path)})
    assert str(info.value) == (f"option 'dump_dir' is {str(path)!r}, which is a file, not a directory; "
                               "give a directory for the dumps")
    assert graphs == []
    # Below a file: the part of the path that exists is named.
    below = path / "graphs"
    with pytest.raises(capturepass.OptionError, match=re.escape(f"below {str(path)!r}, which is a file")):
        Options.from_mapping({"dump_dir": str(below)})
    # From the environment, the variable is named; through torch.compile, before any graph is compiled.
    monkeypatch.setenv(DUMP_DIR_ENV, str(path))
    with new_compiles() as graphs, pytest.raises(Exception) as info:
        torch.compile(lambda x: x.sin(), backend="capturepass", options={"inner": "eager"})(torch.randn(3))
    assert str(unwrap(info.value)).startswith(f"CAPTUREPASS_DUMP_DIR (the option 'dump_dir') is {str(path)!r}, "
                                              "which is a file")
    assert graphs == []
    monkeypatch.delenv(DUMP_DIR_ENV)
    monkeypatch.setenv("CAPTUREPASS_OPTIONS", json.dumps({"dump_dir": str(path)}))
    with pytest.raises(capturepass.OptionError, match=re.escape("option 'dump_dir' (from CAPTUREPASS_OPTIONS) is")):
        Options.from_mapping({})


def _option_error_as(uid: int | None, options: dict) -> str:
    """The OptionError message of ``Options.from_mapping(options)``, in a child process running as ``uid``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, if asked, and report
        os.close(read)
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            try:
                Options.from_mapping(options)
                msg = "accepted"
            except capturepass.OptionError as e:
                msg = str(e)
            os.write(write, msg.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_an_unwritable_dump_dir_is_refused_before_compiling():
    # Root may write anywhere: the check runs as an unprivileged user then (nobody), in a
    # folder of /tmp that user can reach.
    import pathlib
    import shutil
    import tempfile

    uid = 65534 if os.geteuid() == 0 else None
    top = pathlib.Path(tempfile.mkdtemp(prefix="capturepass-options-"))
    os.chmod(top, 0o755)
    base = top / "ro"
    base.mkdir()
    os.chmod(base, 0o555)
    try:
        made = str(base / "dump")
        assert _option_error_as(uid, {"dump_dir": made}) == (
            f"option 'dump_dir' is {made!r}, to be made in {str(base)!r}, a directory this process cannot write; "
            "give one it can write")
        assert _option_error_as(uid, {"dump_dir": str(base)}).startswith(
            f"option 'dump_dir' is {str(base)!r}, a directory this process cannot write")
        os.chmod(base, 0o777)
        assert _option_error_as(uid, {"dump_dir": made}) == "accepted"
    finally:
        os.chmod(base, 0o755)
        shutil.rmtree(top)
