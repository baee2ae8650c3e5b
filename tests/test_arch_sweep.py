"""scripts/arch_sweep.py on the CPU: a decoder, an encoder under a padding mask, an encoder-decoder and a vision
model outside the zoo equal to eager (in two processes at once), generation through host captures, every model's
code through the lanes' rewrite, a crashed process reported on its model, and a bad name refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "arch_sweep.py")


def _load_sweep():
    """scripts/arch_sweep.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arch_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_architectures_outside_the_zoo_compile_equal_to_eager():
    """In two processes at once (``--procs 2``), as on a GPU machine: each model's line comes
    from the process of its shard, and the last line counts them all."""
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt,distilbert,bart,resnet", "--procs", "2"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("opt", "distilbert", "bart", "resnet"):
        assert f"OK   {name}: largest difference" in run.stdout
    assert "4 of 4 equal to eager" in run.stdout


def test_host_captures_read_refilled_inputs_in_place_and_stay_equal_to_eager():
    """``--host-captures``: each graph captures and replays on the host, every input is passed three
    times more in refilled buffers, and every shape of both models is captured again with them
    read in place (three shapes each: the first, and Dynamo's two dynamic recompiles)."""
    run = subprocess.run([sys.executable, SCRIPT, "--host-captures", "--models", "opt,distilbert"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("opt", "distilbert"):
        assert f"OK   {name}: largest difference" in run.stdout
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith(f"OK   {name}:"))
        assert line.endswith("3 shape(s) captured again with inputs read in place"), line
    assert "2 of 2 equal to eager" in run.stdout


def test_every_models_code_through_the_lanes_rewrite_stays_equal_to_eager():
    """``--regions fused``: each compile's Inductor code has its kernels put on lanes by the
    rewrite (run in program order on the host) and passes its order check; the frees it moved
    to a later wait or held to the join are counted per model."""
    run = subprocess.run([sys.executable, SCRIPT, "--regions", "fused", "--host-captures", "--models", "resnet,bart"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("resnet", "bart"):
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith(f"OK   {name}:"))
        fused = re.search(r"lanes after fusion in (\d+) compile\(s\): (\d+) frees moved to a later wait", line)
        assert fused and int(fused.group(1)) >= 2 and int(fused.group(2)) > 0, line
    assert "2 of 2 equal to eager" in run.stdout


# A stand-in for the sweep's process: prints each model's line as the sweep does, a failure with
# its traceback, aborts (a native crash) on a model named "boom" and hangs on one named "hang".
FAKE_SHARD = r"""
import os, sys, time
for name in sys.argv[1].split(","):
    if name == "boom":
        sys.stdout.flush()
        os.abort()
    if name == "hang":
        import subprocess
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a compile worker
        open(os.environ["FAKE_WORKER_PID"], "w").write(str(worker.pid))
        time.sleep(60)
    if name.startswith("bad"):
        print(f"FAIL {name}: RuntimeError: wrong\n     Traceback (most recent call last):\n     RuntimeError: wrong",
              flush=True)
    else:
        print(f"OK   {name}: largest difference 1.00e-07", flush=True)
    time.sleep(0.05)
print("9 of 9 equal to eager", flush=True)
"""


def test_shards_run_at_once_and_a_crash_is_reported_on_its_model(capsys):
    """``--procs``: every shard in a process of its own. A process that dies is reported on the
    model it was on (``CRASH`` with the status), and a new process goes on with the rest of its
    shard; a failure's traceback stays with its line; the processes' own last lines are left out."""
    sweep = _load_sweep()
    shards = [["a1", "boom", "a2", "bad1"], ["b1", "bad2", "b2"], []]
    started = []

    def argv(models):
        started.append(list(models))
        return [sys.executable, "-c", FAKE_SHARD, ",".join(models)]

    kinds = sweep.run_shards(shards, argv, sweep.RESULT, drop=sweep.SUMMARY)
    assert kinds == {"a1": "OK", "boom": "CRASH", "a2": "OK", "bad1": "FAIL", "b1": "OK", "bad2": "FAIL", "b2": "OK"}
    assert sorted(started) == [["a1", "boom", "a2", "bad1"], ["a2", "bad1"], ["b1", "bad2", "b2"]]
    out = capsys.readouterr().out.splitlines()
    assert not any("equal to eager" in line for line in out)
    crash = next(line for line in out if line.startswith("CRASH"))
    assert crash == "CRASH boom: its process ended with status -6 while on it"
    for bad in ("bad1", "bad2"):
        i = out.index(f"FAIL {bad}: RuntimeError: wrong")
        assert out[i + 1:i + 3] == ["     Traceback (most recent call last):", "     RuntimeError: wrong"]
    assert sweep.summary(7, 3, 0, 0, 0) == 1
    assert capsys.readouterr().out == "4 of 7 equal to eager\n"


def test_at_the_deadline_every_process_stops_and_the_models_not_reached_are_named(capsys, tmp_path, monkeypatch):
    """``--deadline``: a process still running then is killed with the processes it started (Inductor's
    compile workers), not reported as a crash, and the models it and the other shards had not
    reported are named in the last line, which fails."""
    import time

    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("FAKE_WORKER_PID", str(pid_file))
    sweep = _load_sweep()
    began = time.monotonic()
    kinds = sweep.run_shards([["a1", "hang", "a2"], ["b1", "b2"]],
                             lambda models: [sys.executable, "-c", FAKE_SHARD, ",".join(models)], sweep.RESULT,
                             drop=sweep.SUMMARY, seconds=3.0)
    assert time.monotonic() - began < 30
    assert kinds == {"a1": "OK", "b1": "OK", "b2": "OK"}
    assert "CRASH" not in capsys.readouterr().out
    status = f"/proc/{pid_file.read_text()}/status"
    for _ in range(100):  # killed at once; gone (or a zombie) once the kernel has delivered it
        if not os.path.exists(status) or "\tZ" in open(status).read():
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the hung process's own child outlived the deadline")
    assert sweep.summary(5, 0, 0, 0, 0, ["hang", "a2"]) == 1
    assert capsys.readouterr().out == "3 of 3 equal to eager; 2 not reached within the deadline: hang,a2\n"


def test_an_unknown_architecture_is_named():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt,nope"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown architecture: nope" in run.stderr


def test_a_deadline_without_processes_to_stop_is_refused():
    run = subprocess.run([sys.executable, SCRIPT, "--models", "opt", "--deadline", "60"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--deadline is for --procs" in run.stderr


def test_another_backend_runs_the_same_calls_and_takes_none_of_capturepasss_options(monkeypatch):
    """``--backend``: the same calls under torch's own backends, to tell a failure of
    capturepass's from one of torch's; capturepass's own options are refused with it."""
    import torch

    sweep = _load_sweep()
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    for backend in ("capturepass", "inductor", "reduce-overhead"):
        sweep._compile(len, backend, {"regions": "fused"})
    assert calls == [{"backend": "capturepass", "options": {"regions": "fused"}}, {"backend": "inductor"},
                     {"mode": "reduce-overhead"}]
    run = subprocess.run([sys.executable, SCRIPT, "--backend", "inductor", "--regions", "fused", "--models", "opt"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--host-captures and --regions are capturepass's options" in run.stderr


def test_a_model_whose_compiles_failed_is_told_apart(monkeypatch):
    """A model equal to eager whose regions Inductor failed to compile (run eagerly, or as lane
    regions instead of one compile) is reported slow: only capturepass's warnings tell it from a
    clean one. The warnings here are capturepass's own, from the two fallbacks; another warning
    (a logged break) is no failed compile."""
    import logging

    import torch

    import capturepass.backends.compile as driver
    from capturepass.backends import fused_inductor, inner
    from capturepass.testing.models import MoEBlock
    from tests.passes.cases import CASES

    sweep = _load_sweep()
    log = logging.getLogger("capturepass")
    real = inner.compile_region

    def inductor_fails(gm, example, compiler):
        if compiler == "inductor":
            raise RuntimeError("simulated inner compiler failure")
        return real(gm, example, compiler)

    torch._dynamo.reset()
    with sweep.Fallbacks() as seen:
        log.warning("capturepass: %%grouped_mm_fallback cannot be captured; it runs eagerly as a break")
        assert seen.messages == []
        # A rebuild's region that Inductor fails on runs eagerly.
        with monkeypatch.context() as m:
            m.setattr(inner, "compile_region", inductor_fails)
            gm = CASES["fork_join"].trace()
            driver.compile_graph(gm, [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"],
                                 {"policy": "hints"}, not_capturable={"nothing": "test"}, record=False)
        assert len(seen.messages) == 1 and "runs its graph eagerly instead" in seen.messages[0]
        # A segment whose one compile fails its lane checks is compiled as lane regions.
        with monkeypatch.context() as m:
            m.setattr(driver, "findings", lambda codes, points: ["line 7 on s1 reads buf3, written on s0"])
            model, x = MoEBlock(), torch.randn(16, 64)
            with torch.no_grad():
                torch.testing.assert_close(torch.compile(model, backend="capturepass", options={"regions": "segments"})(x),
                                           model(x))
        assert len(seen.messages) == 2 and "compiled as lane regions instead" in seen.messages[1]
        # Lanes after fusion whose order check finds a fault run on one lane (Inductor's cache off:
        # a module it loads from there is not rewritten again; its config patched by its own
        # ``patch``, which monkeypatch's undo would delete from the config module).
        with monkeypatch.context() as m, torch._inductor.config.patch(fx_graph_cache=False):
            m.setattr(fused_inductor, "check", lambda source, module: ["lane 1 uses buf2, written on lane 0 with no "
                                                                       "event after"])
            torch._dynamo.reset()
            with torch.no_grad():
                torch.testing.assert_close(torch.compile(model, backend="capturepass", options={"regions": "fused"})(x),
                                           model(x))
        assert len(seen.messages) == 3 and "lanes after fusion left out" in seen.messages[2], seen.messages
    assert seen not in log.handlers
    torch._dynamo.reset()


def test_frames_dynamo_stopped_compiling_are_named():
    """Dynamo's recompile-limit warning (a frame that runs eagerly from then on, under any
    backend) is collected by frame name, once per frame; other Dynamo warnings are not."""
    import logging

    sweep = _load_sweep()
    log = logging.getLogger("torch._dynamo.convert_frame")
    text = ("torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s\n"
            'To log all recompilation reasons, use TORCH_LOGS="recompiles".\nTo diagnose recompilation issues, see %s')
    with sweep.Fallbacks() as seen:
        log.warning("torch._dynamo some other warning")
        for _ in range(2):
            log.warning(text, "recompile_limit", 8, "'wrapped_func' (/x/transformers/utils/deprecation.py:121)",
                        "1/7: not args", "https://example")
        log.warning(text, "accumulated_recompile_limit", 256, "'forward' (/x/model.py:10)", "size", "https://example")
    assert seen.eager_frames == ["wrapped_func", "forward"]
    assert seen.messages == []
    assert seen not in log.parent.handlers


def test_a_mismatch_is_compared_with_inductors_own_difference():
    """An output beyond the tolerance is torch's only where ``backend="inductor"`` is beyond it on
    the same input too and capturepass's difference is of the same order; otherwise it is
    capturepass's failure. Both differences are in the message."""

    import torch

    sweep = _load_sweep()

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 4)

        def forward(self, x):
            return (self.proj(x),)

    torch.manual_seed(0)
    model, kwargs = Head().eval(), {"x": torch.randn(3, 8)}
    tol = {"atol": 1e-5, "rtol": 1.3e-6}

    def inductor():
        return torch.compile(model, backend="inductor")(**kwargs)[0]

    with torch.no_grad():
        ref = model(**kwargs)[0]
        ours = sweep._mismatch(inductor, ref, ref + 0.5, tol)
        assert not ours.inductor_too
        assert "largest difference 5.00e-01" in str(ours) and "not beyond the tolerance" in str(ours)
        # A reference Inductor cannot meet either (here: shifted by 0.25 from the model's own).
        theirs = sweep._mismatch(inductor, ref + 0.25, ref + 0.5, tol)
        assert theirs.inductor_too
        assert "largest difference 2.50e-01; backend=\"inductor\" on the same input 2.50e-01" in str(theirs)
        # Inductor misses the tolerance too, but capturepass is more than twice as far off: a
        # wrong result hidden behind torch's own rounding would be a failure.
        worse = sweep._mismatch(inductor, ref + 0.25, ref + 1.0, tol)
        assert not worse.inductor_too
        assert "largest difference 7.50e-01; backend=\"inductor\" on the same input 2.50e-01 (also beyond" in str(worse)
    torch._dynamo.reset()


def test_an_error_is_torchs_only_where_inductor_fails_the_same_calls_too():
    sweep = _load_sweep()
    ours = RuntimeError("lowering failed\nmore lines")
    assert sweep._failure(ours, lambda: None) is ours

    def inductor_fails():
        raise ValueError("not enough values to unpack")

    shared = sweep._failure(ours, inductor_fails)
    assert isinstance(shared, sweep.Mismatch) and shared.inductor_too
    assert str(shared) == ("RuntimeError: lowering failed; backend=\"inductor\" fails too "
                           "(ValueError: not enough values to unpack)")


def test_another_attention_implementation_and_the_models_without_it():
    """``--attn flex_attention`` with ``--generate``: Granite generates with its attention a
    higher-order op of the graph (a static cache: two shapes, no dynamic recompile, which
    Inductor's CPU lowering of the op does not compile); GPT-BigCode has no such attention and is
    skipped, not failed."""
    run = subprocess.run([sys.executable, SCRIPT, "--generate", "--host-captures", "--attn", "flex_attention",
                          "--models", "granite,gpt_bigcode"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "OK   granite: 24 tokens equal to eager's (static cache;" in run.stdout
    assert "SKIP gpt_bigcode: GPTBigCodeForCausalLM does not support an attention implementation" in run.stdout
    assert "1 of 1 equal to eager (1 skipped)" in run.stdout


def test_decoders_generate_eagers_tokens_through_host_captures():
    """``--generate --host-captures``: three generations of eight tokens, every forward call a
    capture or a replay (24 in all), for a hybrid decoder (Jamba: attention and Mamba layers)
    and an encoder-decoder (BART: self- and cross-attention caches); an encoder is no decoder and
    is skipped."""
    run = subprocess.run([sys.executable, SCRIPT, "--generate", "--host-captures", "--models", "jamba,bart,distilbert"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    for name in ("jamba", "bart"):
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith(f"OK   {name}:"))
        counts = re.search(r"\(static cache; (\d+) captures, (\d+) replays\)", line)
        assert line.startswith(f"OK   {name}: 24 tokens equal to eager's") and counts, line
        assert int(counts[1]) + int(counts[2]) == 24 and int(counts[2]) > int(counts[1]), line
    assert "SKIP distilbert: not a decoder" in run.stdout
    assert "2 of 2 equal to eager (1 skipped)" in run.stdout
