"""benchmarks/gpu_check.py, run with --smoke on a tiny Gemma-3 on the CPU: the device run must not fail for a
silly reason (device time is scarce), and its report must hold every number the GPU targets ask for."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_writes_every_target_number(tmp_path):
    gpu_check = load_script()
    gpu_check.main(["--smoke", "--out", str(tmp_path), "--modes", "off"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    mode = report["modes"]["off"]
    assert "error" not in mode, mode
    params = report["params"]
    assert mode["c1_itl_ms_median"] > 0 and mode["ttft_ms_median"] > 0 and mode["throughput_tok_s"] > 0
    assert len(mode["ttft_ms_all"]) == params["repeats"]
    assert mode["output_tokens"] == params["concurrency"] * params["throughput_tokens"]
    assert report["weights_bytes"] > 0 and mode["step_ms_batch1"] > 0
    assert mode["static_decode"] and len(mode["buckets"]) == 3 * 1  # rows 1, 2, 4; one span (max_len 256)
