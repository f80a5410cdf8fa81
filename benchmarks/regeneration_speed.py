"""Regeneration speed: our in-process engine against vLLM's server on the same prompts, and how often their greedy
answers are the same tokens.

    .venv/bin/python benchmarks/regeneration_speed.py                   # 32 ShareGPT prompts x 128 tokens
    .venv/bin/python benchmarks/regeneration_speed.py --prompts 64 --concurrency 32

The prompts are ShareGPT first turns of at most ``--max-prompt-tokens`` (chat template included). Each side writes a
rollouts folder with ``lightning-spec rollouts``' own code (``generate_rollouts``): the local engine decodes
``--batch-size`` conversations at a time in this process; the server engine sends them to vLLM's OpenAI server
(started from .venv-serve by ``serve_target.py``, stopped at the end), ``--concurrency`` in flight. Both sides run
greedy and at temperature 1, one after the other on the same cores, and print tokens/s and their ratio; then the
share of prompts whose greedy answers are token for token the same, and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from objective_memory import cpu_name  # this folder is on sys.path when the script runs
from serve_target import ROOT, start, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="the local engine's batch (1: one at a time)")
    parser.add_argument("--dtype", default="float32", help="both sides' weights: float32 or bfloat16")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight to the server")
    parser.add_argument("--python", default=str(ROOT / ".venv-serve" / "bin" / "python"))
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()

    from lightning_spec import SamplingConfig, load_target
    from lightning_spec.data.engines import LocalEngine, ServerEngine
    from lightning_spec.data.prompts import select_prompts
    from lightning_spec.data.rollout_writer import Draw, generate_rollouts

    target = load_target(args.target, dtype=args.dtype)
    prompts = select_prompts(target.tokenizer, ["sharegpt"], args.prompts, 0, args.max_prompt_tokens)
    prompt_tokens = sum(len(p["prompt_ids"]) for p in prompts)
    print(f"CPU: {cpu_name()}; {args.dtype}; {len(prompts)} ShareGPT prompts ({prompt_tokens} prompt tokens) x up to "
          f"{args.max_new_tokens} new tokens, first turns", flush=True)
    samplings = {"greedy": SamplingConfig(), "T=1": SamplingConfig(temperature=1.0)}
    results: dict[tuple[str, str], tuple[list, float]] = {}

    def run(side: str, engine, folder: Path) -> None:
        for name, sampling in samplings.items():
            start_time = time.perf_counter()
            draw = Draw(sampling, 1, args.max_new_tokens, max_turns=1)
            rows = generate_rollouts(target, prompts, draw, folder / name, engine=engine, progress=False).to_list()
            seconds = time.perf_counter() - start_time
            results[side, name] = (rows, seconds)
            tokens = sum(len(r["response_ids"]) for r in rows)
            print(f"  {side:<7} {name:<7} {tokens:6d} tokens in {seconds:6.1f} s: {tokens / seconds:7.1f} tokens/s",
                  flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run("local", LocalEngine(target, args.batch_size), Path(tmp) / "local")
        serve = argparse.Namespace(python=args.python, target=args.target, name=None, port=args.port, dtype=args.dtype,
                                   max_model_len=4096, max_num_seqs=max(args.concurrency, 1), kv_gb=4,
                                   start_timeout=600, log=str(Path(tmp) / "vllm.log"))
        proc, url = start(serve)
        try:
            run("server", ServerEngine(url, concurrency=args.concurrency), Path(tmp) / "server")
        finally:
            stop(proc)

    for name in samplings:
        (local, t_local), (served, t_served) = results["local", name], results["server", name]
        rate = (sum(len(r["response_ids"]) for r in served) / t_served) / (
            sum(len(r["response_ids"]) for r in local) / t_local)
        print(f"{name}: server / local tokens/s = {rate:.2f}x")
    local, served = results["local", "greedy"][0], results["server", "greedy"][0]
    same = sum(a["response_ids"] == b["response_ids"] for a, b in zip(local, served))

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    prefix = sum(common(a["response_ids"], b["response_ids"]) for a, b in zip(local, served)) / len(local)
    mean = sum(len(a["response_ids"]) for a in local) / len(local)
    print(f"greedy answers token for token the same: {same}/{len(local)}; mean common prefix {prefix:.1f} of "
          f"{mean:.1f} tokens")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
