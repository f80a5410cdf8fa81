"""The benchmark scripts run end to end on the packaged tiny target (their figures come from SmolLM2 runs in
benchmarks/README.md; here only that they run and print what they promise)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_decode_speed_compares_chain_tree_and_plain():
    out = run("decode_speed.py", "--target", "tiny-random", "--prompts", "2", "--max-new-tokens", "8",
              "--repeats", "2", "--no-peers", "--tree", "6,2", "--threads", "1")
    assert "speculative / plain tokens/s" in out and "tree / chain" in out
    assert "greedy outputs identical on 2/2 prompts" in out  # chain and tree both
    assert "tree of 6+1 tokens (verify)" in out


def test_verify_cost_times_every_size_per_dtype():
    out = run("verify_cost.py", "--target", "tiny-random", "--dtypes", "float32", "--repeats", "1",
              "--prompts", "1", "--max-new-tokens", "4", "--threads", "1", "--prepack")
    for label in ("float32", "float32+pp"):  # the target as loaded, and with prepacked linears
        rows = [line.split() for line in out.splitlines() if line.split()[:1] == [label]]
        assert [int(r[1]) for r in rows[:6]] == [1, 2, 9, 17, 33, 65]
        assert "tokens/s" in rows[-1]
