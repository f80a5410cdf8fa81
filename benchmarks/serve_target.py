"""vLLM's OpenAI-compatible server for a target, on 127.0.0.1, started from the serving venv and stopped afterwards.

    .venv/bin/python benchmarks/serve_target.py -- CMD ...      # start, run CMD, stop (make regenerate)
    .venv/bin/python benchmarks/serve_target.py                 # serve until Ctrl-C (make serve-target)

The target is a packaged name (its converted HF folder is served) or a folder; it is served under ``--name`` (the
packaged name by default), so ``lightning-spec rollouts --backend server`` finds it as the server's only model. The
server's log goes to ``--log``; the command runs once ``/v1/models`` answers, with ``LIGHTNING_SPEC_SERVER_URL`` set to
the server's URL. Whatever the command does, the server is stopped (its whole process group) when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from lightning_spec.assets import resolve_target_folder

    folder = resolve_target_folder(args.target)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name",
           args.name or args.target, "--host", "127.0.0.1", "--port", str(args.port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--generation-config", "vllm", "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gb))}
    log = open(args.log, "w")
    print(f"[serve-target] {' '.join(cmd)}  (log: {args.log})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[serve-target] vLLM exited with {proc.returncode} while starting; see {args.log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                served = [m["id"] for m in json.loads(response.read())["data"]]
            print(f"[serve-target] {url} serves {served}", file=sys.stderr, flush=True)
            return proc, url
        except OSError:
            time.sleep(2)
    stop(proc)
    raise SystemExit(f"[serve-target] vLLM did not answer within {args.start_timeout} s; see {args.log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print("[serve-target] stopped", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=str(ROOT / ".venv-serve" / "bin" / "python"), help="the serving venv's")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--name", default=None, help="the served model name (default: --target)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE unless set")
    parser.add_argument("--start-timeout", type=int, default=600)
    parser.add_argument("--log", default="serve-target.log")
    parser.add_argument("command", nargs="*", help="run this once the server answers, then stop the server")
    args = parser.parse_args()
    if not Path(args.python).exists():
        raise SystemExit(f"[serve-target] {args.python} does not exist; run `make serve-setup` first.")
    proc, url = start(args)
    try:
        if args.command:
            done = subprocess.run(args.command, env={**os.environ, "LIGHTNING_SPEC_SERVER_URL": url})
            raise SystemExit(done.returncode)
        print("[serve-target] serving until Ctrl-C", file=sys.stderr, flush=True)
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
