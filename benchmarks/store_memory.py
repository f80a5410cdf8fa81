"""The feature store's memory as the dataset grows: an epoch of reads from synthetic stores of growing size.

    .venv/bin/python benchmarks/store_memory.py                     # 1k, 4k and 16k examples of 64 tokens
    .venv/bin/python benchmarks/store_memory.py --examples 500 2000 --tokens 128

For each size, one process (so peaks do not mix) writes a store of random features with SmolLM2's shapes (3
context layers and the final hidden state, H = 576: 4.6 KB per token in fp16), then reads every example once in a
shuffled order, 8 per batch, as a training epoch does, and prints the process's resident memory: its peak, and its
anonymous part (what the process holds; file pages the kernel caches are not the process's) before and after the
epoch. A store that loaded itself whole (the single-file cache it replaced) would grow by the store's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def one(examples: int, tokens: int, folder: str) -> dict:
    import torch

    from lightning_spec.features.store import FeatureStore, StoreSpec

    spec = StoreSpec("synthetic", "f", [1, 14, 27], "d", "float32", 576, examples)
    writer = FeatureStore.open(folder, spec, writer="bench")
    g = torch.Generator().manual_seed(0)
    for i in range(examples):
        writer.put(i, torch.randn(tokens, 3 * 576, generator=g), torch.randn(tokens, 576, generator=g))
    writer.flush()
    del writer
    size = sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors")) // 2**20
    reader = FeatureStore.open(folder, spec)
    before = status()
    order = torch.randperm(examples, generator=g).tolist()
    start = time.perf_counter()
    for lo in range(0, examples, 8):
        batch = [reader.get(i) for i in order[lo : lo + 8]]
        torch.stack([f.float() for f, _ in batch]).sum()  # used, as a step would
    seconds = time.perf_counter() - start
    after = status()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return {"examples": examples, "store_mb": size, "anon_before": before["RssAnon"], "anon_after": after["RssAnon"],
            "rss_after": after["VmRSS"], "peak_rss": peak, "read_ms_per_batch": 1e3 * seconds / (examples / 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process's size
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.tokens, args.folder)))
        return
    from objective_memory import cpu_name  # this folder is on sys.path when the script runs

    print(f"CPU: {cpu_name()}; examples of {args.tokens} tokens, SmolLM2 shapes (4.6 KB per token in fp16)")
    print(f"{'examples':>9} {'store MB':>9} {'anon MB before':>15} {'anon MB after':>14} {'peak RSS MB':>12} "
          f"{'ms per batch of 8':>18}")
    for n in args.examples:
        with tempfile.TemporaryDirectory() as folder:
            out = subprocess.run([sys.executable, __file__, "--one", str(n), "--tokens", str(args.tokens), "--folder",
                                  folder], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{r['examples']:>9} {r['store_mb']:>9} {r['anon_before']:>15} {r['anon_after']:>14} {r['peak_rss']:>12} "
              f"{r['read_ms_per_batch']:>18.2f}", flush=True)


if __name__ == "__main__":
    main()
