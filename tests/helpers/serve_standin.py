"""A stand-in for benchmarks/serve_vllm.py that decodes with our own engine, so tests/integration/test_benchmarks.py
can run benchmarks/serve_check.py end to end without vLLM. It answers in serve_vllm.py's JSON and counts the way vLLM
does: the prefill gives the first token, then one draft per verification forward (so drafts = our rounds - 1). What
it "built" is what the folder says vLLM must build (``checkpoint.served_fields``), less the dotted field named by
$STANDIN_DROP: a faithful engine, or one that drops a field."""

import argparse
import json
import os
import time

from lightning_spec import generate, load_drafter, load_target
from lightning_spec.checkpoint import served_fields


def built(folder: str, drop: str | None) -> dict:
    """``served_fields`` of ``folder`` nested as vLLM's configs are, without the field ``drop``."""
    out: dict = {}
    for path, value in served_fields(folder).items():
        if path == drop:
            continue
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


parser = argparse.ArgumentParser()
parser.add_argument("--job", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
job = json.load(open(args.job))
target = load_target(job["target"])
spec = job["speculative"]
drafter = load_drafter(spec["model"], target=target) if spec else None
if getattr(drafter, "prefix_scheduler", False):
    drafter.prefix_scheduler = False  # DSpark: vLLM submits the whole block unless adaptive verification is on
tokens, seconds, drafts, accepted = [], [], 0, 0
for ids in job["prompts"]:
    start = time.perf_counter()
    out = generate(target, ids, job["max_new_tokens"], drafter=drafter)
    seconds.append(time.perf_counter() - start)
    tokens.append(out.tokens)
    drafts += out.rounds - 1 if spec else 0
    accepted += sum(out.accept_lengths)
json.dump({"tokens": tokens, "seconds": seconds, "load_seconds": 0.0, "drafts": drafts,
           "draft_tokens": drafts * (spec or {}).get("num_speculative_tokens", 0), "accepted": accepted,
           "accepted_per_position": [],
           "built": built(spec["model"], os.environ.get("STANDIN_DROP")) if spec else None}, open(args.out, "w"))
