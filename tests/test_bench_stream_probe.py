"""bench/stream_switch_probe.py on the CPU: how it reads output code and a profiler trace."""

from __future__ import annotations

import json

from tests.test_bench_zoo import _load


def test_the_probe_counts_stream_reads_and_names_each_kernels_stream(tmp_path):
    probe = _load("stream_switch_probe")
    code = "\n".join([
        "from torch._C import _cuda_getCurrentRawStream as get_raw_stream",
        "stream0 = get_raw_stream(0)",
        "triton_poi_fused_mul_sin_0.run(arg0_1, buf0, 1048576, stream=stream0)",
        "buf1 = torch.ops.cpprobe.to_lane.default(buf0, 1)",
        "stream0 = get_raw_stream(0)",
        "triton_poi_fused_add_cos_1.run(buf1, buf2, 1048576, stream=stream0)",
    ])
    got = probe.code_summary(code)
    assert got["get_raw_stream_reads"] == 2 and len(got["lines"]) == 5
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "triton_poi_fused_add_cos_1", "ts": 20, "args": {"stream": 13}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5},
        {"cat": "kernel", "name": "triton_poi_fused_mul_sin_0", "ts": 10, "args": {"stream": 7}},
    ]}))
    assert probe.kernel_streams(str(trace)) == [("triton_poi_fused_mul_sin_0", 7), ("triton_poi_fused_add_cos_1", 13)]
