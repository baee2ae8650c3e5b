"""bench/zoo.py on the CPU: arguments, model configs, the report's arithmetic."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_zoo_bench_help_and_unknown_model():
    script = os.path.join(ROOT, "bench", "zoo.py")
    ok = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--variants" in ok.stdout
    bad = subprocess.run([sys.executable, script, "--models", "llama,nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown model or variant: nope" in bad.stderr


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "mixtral", "qwen3_moe", "deepseek_v3", "gpt2", "mamba"])
def test_zoo_bench_models_build_at_their_sizes(name):
    pytest.importorskip("transformers")
    bench = _load("zoo")
    model, vocab = bench.build(name, "meta")
    config = model.config
    for key, value in bench.SIZES[name].items():
        assert getattr(config, key) == value, key
    assert vocab == 32000
    width = getattr(config, "hidden_size", None) or config.n_embd
    assert width >= 1024
    # A forward on the meta device checks the shapes a config derives from the sizes it was given.
    with torch.no_grad():
        logits = model(torch.zeros(2, 3, dtype=torch.long, device="meta")).logits
    assert logits.shape == (2, 3, vocab)


def test_zoo_bench_decoder_workload_shapes():
    pytest.importorskip("transformers")
    import argparse

    bench = _load("zoo")
    args = argparse.Namespace(model="llama", device="cpu", sizes="zoo", decode=4, prefill="2,8")
    model, shapes, output = bench.workload(args)
    assert list(shapes) == ["decode[4,1]", "prefill[2,8]"]
    first, again, other = shapes["prefill[2,8]"](0), shapes["prefill[2,8]"](0), shapes["prefill[2,8]"](1)
    assert first["input_ids"].shape == (2, 8) and first["use_cache"] is False
    assert torch.equal(first["input_ids"], again["input_ids"]) and not torch.equal(first["input_ids"], other["input_ids"])
    with torch.no_grad():
        assert output(model(**shapes["decode[4,1]"](0))).shape[:2] == (4, 1)


def test_zoo_bench_branch_models_are_known_by_name():
    bench = _load("zoo")
    assert set(bench.branch_models.MODELS) == {"googlenet", "inception_v3", "flux", "sd3"}
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        bench.branch_models.build("nope", "cpu")
    script = os.path.join(ROOT, "bench", "zoo.py")
    bad = subprocess.run([sys.executable, script, "--models", "flux,googlenet,nope"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown model or variant: nope (" in bad.stderr


def test_zoo_bench_report_ratios():
    bench = _load("zoo")
    rows = []
    for variant, times in {"reduce-overhead": [1.0, 1.2, 1.1], "capturepass-off": [1.05], "capturepass": [0.99]}.items():
        for t in times:
            rows.append(dict(model="qwen2_moe", variant=variant, shape="decode[8,1]", ms=t, compile_s=2.0,
                             peak_mib=10.0, rel_err=0.0))
    table = bench.report(rows, ["qwen2_moe"], ["reduce-overhead", "capturepass-off", "capturepass"])
    line = next(x for x in table.splitlines() if x.startswith("| qwen2_moe (shared expert)"))
    # medians: reduce-overhead 1.1 (of three processes: their range too), off 1.05, capturepass
    # 0.99 -> 0.99 / 1.05 and 1.1 / 0.99
    assert line == ("| qwen2_moe (shared expert) | decode[8,1] | 1.1000 (1.0000-1.2000) | 1.0500 | 0.9900 | 0.943 "
                    "| 1.111 |")


def test_zoo_bench_report_reads_the_uncaptured_bar_against_inductor():
    bench = _load("zoo")
    times = {"inductor": 2.0, "capturepass-uncaptured": 2.1, "capturepass": 0.5}
    rows = [dict(model="llama", variant=v, shape="decode[8,1]", ms=t, compile_s=2.0, peak_mib=10.0, rel_err=0.0)
            for v, t in times.items()]
    table = bench.report(rows, ["llama"], list(times)).splitlines()
    assert table[0].endswith("| cp / inductor | uncaptured / inductor |")
    line = next(x for x in table if x.startswith("| llama |"))
    assert line == "| llama | decode[8,1] | 2.0000 | 2.1000 | 0.5000 |  |  | 0.250 | 1.050 |"


def test_zoo_bench_report_lists_each_capture_replayed_alone_once():
    bench = _load("zoo")
    replays = [{"owner": "g0.m0.c0.one_lane", "replay_ms": 0.25,
                "choices": ["schedule for (int64[8, 1]) on H200 sm90: one_lane (1 lane(s)), measured fastest"]}]
    rows = [dict(model="gpt2", variant="capturepass", shape=s, ms=0.3, compile_s=2.0, peak_mib=1.0, rel_err=0.0,
                 replays=replays) for s in ("decode[8,1]", "prefill[2,128]")]
    rows.append(dict(model="gpt2", variant="capturepass-off", shape="decode[8,1]", ms=0.27, compile_s=1.0,
                     peak_mib=1.0, rel_err=0.0, replays=[{"owner": "g0.m0.c0", "replay_ms": 0.26, "choices": []}]))
    table = bench.report(rows, ["gpt2"], ["capturepass-off", "capturepass"])
    assert [x for x in table.splitlines() if x.startswith("replay alone")] == [
        "replay alone: gpt2 capturepass g0.m0.c0.one_lane: 0.2500 ms; schedule for (int64[8, 1]) on H200 sm90: "
        "one_lane (1 lane(s)), measured fastest",
        "replay alone: gpt2 capturepass-off g0.m0.c0: 0.2600 ms; schedule: the cost model's (not measured)",
    ]


def test_zoo_bench_report_sets_the_replay_alone_beside_a_whole_call_on_its_inputs():
    bench = _load("zoo")
    replays = [{"owner": "g0.m0.c0", "replay_ms": 0.25, "choices": [], "shape": "decode[8,1]", "call_ms": 0.26}]
    rows = [dict(model="qwen2_moe", variant="capturepass", shape="decode[8,1]", ms=0.27, compile_s=2.0, peak_mib=1.0,
                 rel_err=0.0, replays=replays)]
    line = next(x for x in bench.report(rows, ["qwen2_moe"], ["capturepass"]).splitlines() if x.startswith("replay"))
    assert line == ("replay alone: qwen2_moe capturepass g0.m0.c0: 0.2500 ms (whole call on the same inputs 0.2600 ms, "
                    "1.040x); schedule: the cost model's (not measured)")


def test_host_overhead_bench_times_every_layer():
    pytest.importorskip("transformers")
    bench = _load("host_overhead")
    times = bench.layers("gpt2", 2, 1, iters=2, rounds=1)
    assert list(times) == ["region", "program", "executor", "capturepass", "one lane", "inductor"]
    assert all(t > 0 for t in times.values())
    assert {"llama", "qwen2_moe", "mamba"} <= set(bench.decoders()) and "bert" not in bench.decoders()


def test_host_overhead_bench_builds_the_zoo_benchs_realistic_sizes():
    pytest.importorskip("transformers")
    import torch

    bench = _load("host_overhead")
    model, ids = bench.model_and_ids("gpt2", 2, 3, "cpu", "real")
    assert model.config.n_embd == 1024 and model.config.n_layer == 4 and not model.training
    assert next(model.parameters()).dtype == torch.bfloat16
    assert ids.shape == (2, 3) and int(ids.max()) < model.config.vocab_size == 32000
    tiny, tiny_ids = bench.model_and_ids("gpt2", 2, 3, "cpu", "zoo")
    assert tiny.config.n_embd < 1024 and next(tiny.parameters()).dtype == torch.float32 and tiny_ids.shape == (2, 3)


def test_host_overhead_bench_pairs_rounds_of_small_modules(monkeypatch):
    bench = _load("host_overhead")
    cases = bench.small_modules()
    assert list(cases) == ["x + 1", "nn.Linear(8, 8)", "KV-cache write + attention", "MLP 64-256-64 on [32, 64]"]
    monkeypatch.setattr(bench, "small_modules", lambda: {"x + 1": cases["x + 1"][:2] + (3,)})
    ((name, (inductor, ours, ratio)),) = bench.paired(rounds=3).items()
    assert name == "x + 1" and inductor > 0 and ours > 0 and ratio > 0


def test_host_profile_names_where_the_calls_spend_their_time():
    zoo = _load("zoo")

    def slow_part():
        return sum(range(2000))

    text = zoo.host_profile(lambda: slow_part(), iters=7)
    line = next(ln for ln in text.splitlines() if "slow_part" in ln)
    assert line.split()[0] == "7" and "Ordered by: internal time" in text


def test_peak_sites_sum_the_blocks_live_at_the_peak_by_where_they_were_allocated():
    zoo = _load("zoo")
    frame = lambda f, line, name: {"filename": f, "line": line, "name": name}  # noqa: E731
    tuning = [frame("/x/site-packages/torch/_dynamo/testing.py", 462, "rand_strided"),
              frame("/x/site-packages/torch/_inductor/standalone_compile.py", 500, "standalone_compile"),
              frame("/x/capturepass/backends/inner.py", 24, "_inductor")]
    model = [frame("/x/site-packages/transformers/llama.py", 122, "forward")]
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 10 * mib, "frames": model},
        {"action": "alloc", "addr": 2, "size": 125 * mib, "frames": tuning},
        {"action": "alloc", "addr": 3, "size": 5 * mib, "frames": tuning},
        {"action": "free_requested", "addr": 3, "size": 5 * mib, "frames": tuning},
        {"action": "free_requested", "addr": 2, "size": 125 * mib, "frames": tuning},
        {"action": "alloc", "addr": 4, "size": 100 * mib, "frames": model},  # below the peak (140)
    ]
    text = zoo.peak_sites({"device_traces": [trace]})
    tuned = "torch/_dynamo/testing.py:462 rand_strided <- capturepass/backends/inner.py:24 _inductor"
    assert text.splitlines() == [
        "peak of the recorded history: 140.0 MiB in 3 block(s), 130.0 MiB of them allocated under capturepass",
        f"     130.0 MiB  {tuned}",
        "      10.0 MiB  transformers/llama.py:122 forward",
        f"largest blocks: 125.0 MiB ({tuned}), 10.0 MiB (transformers/llama.py:122 forward), 5.0 MiB ({tuned})",
    ]
    # Blocks of two streams at the peak: what each stream's pool holds.
    for entry, stream in zip(trace, (7, 13, 7, 7, 13, 7)):
        entry["stream"] = stream
    assert zoo.peak_sites({"device_traces": [trace]}).splitlines()[3] == (
        "by stream: 0xd 125.0 MiB in 1 block(s), 0x7 15.0 MiB in 2 block(s)")


def test_own_peak_counts_only_the_blocks_the_variants_calls_allocated():
    """The bench's reference (allocated outside ``run_variant``) is live across the variant's
    first call and lifts the overall peak; the variant's own peak is its blocks alone, freed
    ones included only while they lived."""
    zoo = _load("zoo")
    frame = lambda f, line, name: {"filename": f, "line": line, "name": name}  # noqa: E731
    bench = [frame("/x/site-packages/transformers/llama.py", 122, "forward"), frame("/x/bench/zoo.py", 190, "worker")]
    variant = [frame("/x/capturepass/runtime/replay.py", 177, "_warm"), frame("/x/bench/zoo.py", 161, "run_variant"),
               frame("/x/bench/zoo.py", 195, "worker")]
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 30 * mib, "frames": bench},     # the eager reference
        {"action": "alloc", "addr": 2, "size": 20 * mib, "frames": variant},   # a warm-up temporary
        {"action": "alloc", "addr": 3, "size": 15 * mib, "frames": variant},
        {"action": "free_requested", "addr": 2, "size": 20 * mib, "frames": variant},
        {"action": "alloc", "addr": 4, "size": 10 * mib, "frames": variant},   # 25 live: below 35
        {"action": "free_requested", "addr": 1, "size": 30 * mib, "frames": bench},
    ]
    snapshot = {"device_traces": [trace]}
    assert zoo.own_peak(snapshot) == 35 * mib
    assert zoo.peak_sites(snapshot).splitlines()[0].startswith("peak of the recorded history: 65.0 MiB")
    rows = [dict(model="llama", variant="capturepass", shape="decode[8,1]", ms=0.3, compile_s=2.0, peak_mib=65.0,
                 own_peak_mib=35.0, rel_err=0.0),
            dict(model="llama", variant="reduce-overhead", shape="decode[8,1]", ms=0.3, compile_s=2.0, peak_mib=50.0,
                 own_peak_mib=None, rel_err=0.0)]
    table = zoo.report(rows, ["llama"], ["reduce-overhead", "capturepass"])
    assert "| llama | decode[8,1] | 2.0 / 50 | 2.0 / 65 (35 own) |" in table.splitlines()


def test_only_synchronising_calls_count_as_syncs_not_the_modes_notice():
    bench = _load("zoo")
    notice = ("Synchronization debug mode is a prototype feature and does not yet detect all "
              "synchronizing operations")
    assert bench.count_syncs([notice]) == 0
    raised = bench.SYNC_WARNING + " (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:160.)"
    assert bench.count_syncs([notice, raised, "other", bench.SYNC_WARNING]) == 2


def test_processes_paced_by_their_host_are_listed_with_their_switches_and_cores():
    bench = _load("zoo")
    common = dict(model="mixtral", shape="decode[8,1]", compile_s=2.0, peak_mib=1.0, rel_err=0.0)
    rows = [dict(common, variant="capturepass", ms=0.3043, host_ms=0.2964, host_ms_max=0.31, preempted=4, cpus=[3, 9]),
            dict(common, variant="capturepass", ms=0.2678, host_ms=0.1725, host_ms_max=0.18, preempted=0, cpus=[5]),
            dict(common, variant="reduce-overhead", ms=0.2679, host_ms=0.2500, preempted=0, cpus=[2])]
    table = bench.report(rows, ["mixtral"], ["reduce-overhead", "capturepass"])
    # 0.2964 >= 0.9 * 0.3043 and 0.2500 >= 0.9 * 0.2679; 0.1725 is not
    assert [x for x in table.splitlines() if x.startswith("paced by the host")] == [
        "paced by the host: mixtral capturepass decode[8,1]: 0.3043 ms, host 0.2964 (slowest loop 0.3100), "
        "involuntary switches 4, cores [3, 9]",
        "paced by the host: mixtral reduce-overhead decode[8,1]: 0.2679 ms, host 0.2500 (slowest loop 0.2500), "
        "involuntary switches 0, cores [2]",
    ]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="/proc/self/stat is Linux's")
def test_current_cpu_is_one_of_the_cores_this_process_may_run_on():
    bench = _load("zoo")
    assert bench.current_cpu() in os.sched_getaffinity(0)


def test_cpu_rows_are_not_listed_as_paced_by_the_host():
    bench = _load("zoo")
    rows = [dict(model="llama", variant="capturepass", shape="decode[8,1]", device="cpu", ms=1.0, host_ms=1.0,
                 compile_s=2.0, peak_mib=0.0, rel_err=0.0)]
    table = bench.report(rows, ["llama"], ["capturepass"])
    assert not [x for x in table.splitlines() if x.startswith("paced by the host")]


def test_zoo_bench_compile_table_gives_the_first_three_calls_where_timed():
    """Beside the first call, the first three calls: cudagraph trees record at a shape's second
    call, capturepass at its first, so only the three calls hold every variant's capture. Rows of
    an older run without them show the first call alone."""
    bench = _load("zoo")
    common = dict(model="llama", shape="decode[8,1]", ms=0.3, peak_mib=100.0, rel_err=0.0)
    rows = [dict(common, variant="reduce-overhead", compile_s=10.0, ready_s=12.5),
            dict(common, variant="reduce-overhead", compile_s=11.0, ready_s=13.5),
            dict(common, variant="capturepass", compile_s=18.0, ready_s=18.25),
            dict(common, variant="capturepass-off", compile_s=13.0)]
    table = bench.report(rows, ["llama"], ["reduce-overhead", "capturepass", "capturepass-off"]).splitlines()
    head = next(i for i, x in enumerate(table) if "compile s (three calls) / peak MiB" in x)
    assert table[head + 2] == "| llama | decode[8,1] | 10.5 (13.0) / 100 | 18.0 (18.2) / 100 | 13.0 / 100 |"


def test_a_capture_measured_inside_the_timing_turn_does_not_wait_on_it(tmp_path, monkeypatch):
    # A DiT's first shape, timed after its second made Dynamo compile a dynamic graph, runs
    # through that graph and is captured there: capturepass measures its candidates inside the
    # worker's timing turn. With a lock of its own on the file the worker waited on itself until
    # the bench's time limit.
    import threading

    from capturepass.runtime.pick import measuring_turn

    zoo = _load("zoo")
    lock = str(tmp_path / "lock")
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", lock)
    for release in ("go", "exit"):
        open(f"{lock}.{release}", "w").close()
    done = threading.Event()

    def timed_calls():
        with zoo.turn(lock):
            with measuring_turn():
                pass
        done.set()

    t = threading.Thread(target=timed_calls, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set()
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", str(tmp_path / "another"))
    with pytest.raises(AssertionError, match="not its pickers'"):
        with zoo.turn(lock):
            pass


def test_compiles_on_a_gpu_take_the_timing_lock_and_on_the_cpu_do_not(tmp_path, monkeypatch):
    # Another worker's compile on the GPU (Inductor's tuning, reduce-overhead's recording) beside
    # capturepass's measured choice slowed its candidates unevenly: three processes of one model
    # chose three schedules. A worker compiles in the turn its pickers and timings take.
    from tests.runtime.test_pick_lock import _locked_elsewhere

    zoo = _load("zoo")
    lock = str(tmp_path / "lock")
    monkeypatch.setenv("CAPTUREPASS_PICK_LOCK", lock)
    with zoo.compile_turn(True):
        assert _locked_elsewhere(lock)  # another worker waits
    assert not _locked_elsewhere(lock)
    with zoo.compile_turn(False):
        assert not _locked_elsewhere(lock)


def test_replay_alone_times_the_captures_a_shapes_calls_run(monkeypatch):
    # A DiT's first shape, once its second made Dynamo compile a dynamic graph, runs through that
    # graph's capture: the replay alone is of the captures named for the shape, whichever graph
    # compiled them, and no other.
    from tests.helpers import capture_on_host

    zoo = _load("zoo")
    capture_on_host(monkeypatch.setattr)
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 8)
    fn = torch.compile(lin, backend="capturepass", dynamic=True,
                       options={"cudagraphs": "monolithic", "inner": "eager"})
    before = zoo.capture_owners()
    with torch.no_grad():
        fn(torch.randn(3, 8))
        first = zoo.capture_owners() - before
        fn(torch.randn(5, 8))
        second = zoo.capture_owners() - before - first
        assert len(first) == 1 and len(second) == 1
        # A call that captures nothing keeps the shape's captures; one that does names its own.
        made = zoo.capture_owners()
        fn(torch.randn(5, 8))
        assert zoo.serving(made, second | {"g9.released"}) == second
        assert zoo.serving(before, set()) == first | second
        replayed = []
        monkeypatch.setattr(zoo, "timed", lambda f, iters, device: (f(), replayed.append(1), 0.5)[2])
        reps = zoo.replay_times(2, second, lambda: fn(torch.randn(5, 8)))
    assert [r["owner"] for r in reps] == sorted(second) and replayed == [1]
    assert reps[0]["replay_ms"] == 0.5
