"""The target forward against its memory floor, per dtype and per decoding path, and plain decoding with each.

    .venv/bin/python benchmarks/forward_floor.py                        # SmolLM2, fp32 and bf16, fast and transformers
    .venv/bin/python benchmarks/forward_floor.py --threads 1 --repeats 30

At one query token a forward streams every weight once, so its floor is the bytes it reads (every parameter, the
input embedding of an untied model excepted: one row of it is read) over the memory bandwidth, measured in the same
run as the best of five sums over an fp32 buffer four times the weights' size. Against a warm KV cache of
``--cache-len`` MT-Bench tokens, each target runs 1, 9 and 17 query tokens (a chain verify), the cache cropped back
after every run, every (dtype, path) interleaved repeat by repeat so a change of load hits all alike; medians in ms.
``fast`` is ``FastForward`` (``lightning_spec/fast_forward.py``), ``transformers`` the model's own forward; the
warm-up is the first forward's time (building the fast path: fusing, and reordering bf16 weights for oneDNN).
Then plain greedy decoding (``generate`` without a drafter) with each, interleaved prompt by prompt: tokens/s, the
ratio to the fastest, and whether the greedy output equals the first row's (fp32 is exact; bf16 rounds
differently).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_speed import mt_bench_prompts  # this folder is on sys.path when the script runs
from lightning_spec import generate, load_target
from objective_memory import cpu_name

SIZES = (1, 9, 17)


def bandwidth_gbs(nbytes: int, device: str = "cpu") -> float:
    """Read bandwidth in GB/s: the best of five sums over an fp32 buffer of ``nbytes`` (past every cache)."""
    buf = torch.ones(max(nbytes // 4, 1 << 26), dtype=torch.float32, device=device)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return buf.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    """Wall seconds of ``fn()``, queued GPU work included."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bytes_read(target) -> int:
    """Bytes a 1-token forward reads: every parameter once (a tied LM head is the embedding), less an untied input
    embedding, of which one row is read."""
    total = sum(p.numel() * p.element_size() for p in target.model.parameters())
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def forward_runs(targets: dict, ctx: torch.Tensor, sizes=SIZES, tree=None) -> dict:
    """(label, "chain", T) -> a function running T query tokens against the warm cache of ``ctx`` and cropping it
    back; with ``tree`` (T, vocab -> ids, depths, ancestor mask) also (label, "tree", T) for T > 1, the same number of
    tokens under that tree's mask (``verify_cost.py``)."""
    runs = {}
    for label, target in targets.items():
        cache = target.new_cache()
        target(ctx, cache=cache, logits=False)
        past = cache.get_seq_length()
        for t in sizes:
            ids = torch.randint(0, target.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)).to(ctx.device)

            def chain(target=target, cache=cache, past=past, ids=ids):
                target(ids, cache=cache)
                target.crop(cache, past)

            runs[(label, "chain", t)] = chain
            if tree is not None and t > 1:
                nodes, depth, mask = tree(t, target.vocab_size)

                def grown(target=target, cache=cache, past=past, nodes=nodes, depth=depth, mask=mask):
                    target(nodes[None].to(ctx.device), cache=cache, positions=depth, tree_mask=mask)
                    target.crop(cache, past)

                runs[(label, "tree", t)] = grown
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--paths", nargs="+", default=["fast", "transformers"], help="fast, transformers")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--prompts", type=int, default=4, help="prompts for plain decoding")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    targets, warmup = {}, {}
    for dtype in args.dtypes:
        for path in args.paths:
            target = load_target(args.target, dtype=dtype, device=args.device, decode=path)
            label = f"{dtype} {path}"
            start = time.perf_counter()
            target(torch.tensor([[1, 2, 3]], device=target.device), cache=target.new_cache())  # builds the fast path
            warmup[label] = time.perf_counter() - start
            targets[label] = target
    first = next(iter(targets.values()))
    prompts = mt_bench_prompts(first, max(args.prompts, 1), 0)
    flat = [t for p in prompts for t in p]
    ctx = torch.tensor([(flat * (args.cache_len // len(flat) + 1))[: args.cache_len]], device=first.device)
    runs = forward_runs(targets, ctx)
    for run in runs.values():  # warm-up: every shape once
        run()
    samples = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            samples[key].append(_timed(fn))
    ms = {(label, t): 1e3 * statistics.median(v) for (label, _, t), v in samples.items()}
    buffer = 4 * max(bytes_read(t) for t in targets.values())
    gbs = bandwidth_gbs(buffer, args.device)

    print(f"\nforward_floor  target={args.target}  {cpu_name()}  threads={torch.get_num_threads()}  "
          f"torch {torch.__version__}  warm cache {ctx.shape[1]} tokens, median of {args.repeats}")
    print(f"  read bandwidth {gbs:.1f} GB/s (best of 5 sums over a {buffer / 1e9:.1f} GB fp32 buffer)")
    print(f"  {'dtype path':<24}{'MB read':>8}{'floor ms':>9}{'T=1 ms':>8}{'x floor':>8}{'T=9 ms':>8}{'x T=1':>7}"
          f"{'T=17 ms':>8}{'x T=1':>7}{'warm-up s':>10}")
    for label, target in targets.items():
        mb = bytes_read(target) / 1e6
        floor = mb / 1e3 / gbs * 1e3
        one = ms[(label, 1)]
        print(f"  {label:<24}{mb:>8.0f}{floor:>9.1f}{one:>8.1f}{one / floor:>7.2f}x{ms[(label, 9)]:>8.1f}"
              f"{ms[(label, 9)] / one:>6.2f}x{ms[(label, 17)]:>8.1f}{ms[(label, 17)] / one:>6.2f}x"
              f"{warmup[label]:>10.1f}")
    plain_decoding(targets, prompts, args.max_new_tokens)


def plain_decoding(targets: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    print(f"\n  plain greedy decoding, {len(prompts)} MT-Bench prompts x {max_new_tokens} tokens, interleaved")
    tokens = {label: 0 for label in targets}
    seconds = {label: 0.0 for label in targets}
    outputs = {label: [] for label in targets}
    for target in targets.values():
        generate(target, prompts[0], 4)  # warm-up
    for ids in prompts:
        for label, target in targets.items():
            out = generate(target, ids, max_new_tokens)
            tokens[label] += len(out.tokens)
            seconds[label] += out.seconds
            outputs[label].append(out.tokens)
    best = max(tokens[label] / seconds[label] for label in targets)
    first = next(iter(targets))
    for label in targets:
        tps = tokens[label] / seconds[label]
        same = sum(a == b for a, b in zip(outputs[label], outputs[first]))
        print(f"  {label:<24}{tps:>8.2f} tokens/s  {tps / best:.2f}x the fastest   "
              f"greedy output = {first}'s on {same}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
