"""What a verify forward of T query tokens costs against a 1-token forward, per dtype, chain vs tree mask.

    .venv/bin/python benchmarks/verify_cost.py                         # SmolLM2, fp32 and bf16, T = 1..65
    .venv/bin/python benchmarks/verify_cost.py --dtypes float32 --threads 2
    .venv/bin/python benchmarks/verify_cost.py --transformers           # + each dtype through transformers' forward

Against a warm KV cache of ``--cache-len`` real tokens (MT-Bench prompts), ``Target.forward`` (our shared-KV SDPA
path, the one ``generate`` uses) runs T = 1, 2, 9, 17, 33, 65 query tokens: causally (a chain of T - 1 drafts after
the anchor) and under a tree mask of the same size (a best-first tree's ancestor mask, 4 children per node), the
cache cropped back after every run. All sizes and dtypes are interleaved repeat by repeat, so a change of load
hits every figure alike; medians in ms and each one's ratio to the 1-token forward of its dtype. Also times
plain greedy decoding per dtype (``generate`` without a drafter, same prompts) and says how often bf16's greedy
output equals fp32's: the fastest plain decoding on this CPU is what speculative decoding has to beat. Targets run
``FastForward`` (``lightning_spec/fast_forward.py``); with ``--transformers`` every dtype also runs through
transformers' own forward (``load_target(..., decode="transformers")``, rows labelled ``<dtype>+hf``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_speed import mt_bench_prompts  # this folder is on sys.path when the script runs
from forward_floor import forward_runs, plain_decoding
from lightning_spec import TreeConfig, load_target
from lightning_spec.decoding.proposals import TreeProposal
from lightning_spec.decoding.trees import best_first_tree
from objective_memory import cpu_name

SIZES = [1, 2, 9, 17, 33, 65]


def tree_inputs(t: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids (T,), depths (T,) and the ancestor mask (T, T) of a best-first tree of T - 1 nodes (top 4 per node)."""
    g = torch.Generator().manual_seed(t)
    q = torch.rand(8, 64, generator=g).softmax(-1)
    index, parents = best_first_tree(q, TreeConfig(nodes=t - 1, top_k=4))
    proposal = TreeProposal(tokens=index % vocab, parents=parents)
    return proposal.verify_inputs(torch.tensor([1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--prompts", type=int, default=4, help="prompts for the plain-decoding comparison")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--transformers", action="store_true", help="also time each dtype through transformers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    targets = {d: load_target(args.target, dtype=d) for d in args.dtypes}
    if args.transformers:
        targets.update({f"{d}+hf": load_target(args.target, dtype=d, decode="transformers") for d in args.dtypes})
    first = next(iter(targets.values()))
    prompts = mt_bench_prompts(first, max(args.prompts, 1), 0)
    flat = [t for p in prompts for t in p]
    ctx = torch.tensor([(flat * (args.cache_len // len(flat) + 1))[: args.cache_len]])

    runs = forward_runs(targets, ctx, SIZES, tree=tree_inputs)
    samples = {key: [] for key in runs}
    for rep in range(args.repeats + 2):  # two warm-up rounds
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            if rep >= 2:
                samples[key].append(time.perf_counter() - start)
    ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}

    print(f"\nverify_cost  target={args.target}  {cpu_name()}  threads={torch.get_num_threads()}  "
          f"torch {torch.__version__}  warm cache {ctx.shape[1]} tokens, median of {args.repeats} (ms)")
    print(f"  {'dtype':<13}{'T':>4}{'chain ms':>10}{'x 1-token':>11}{'tree ms':>10}{'x 1-token':>11}")
    for dtype in targets:
        one = ms[(dtype, "chain", 1)]
        for t in SIZES:
            c = ms[(dtype, "chain", t)]
            tr = ms.get((dtype, "tree", t))
            tree_cols = f"{tr:>10.1f}{tr / one:>10.2f}x" if tr is not None else f"{'':>10}{'':>11}"
            print(f"  {dtype:<13}{t:>4}{c:>10.1f}{c / one:>10.2f}x{tree_cols}")

    plain_decoding(targets, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
