"""What one round's proposal costs per drafter family, as a fraction of the target's 1-token forward, per dtype.

    .venv/bin/python benchmarks/draft_cost.py                         # every family, SmolLM2, fp32 and bf16, K = 8
    .venv/bin/python benchmarks/draft_cost.py --families eagle3 mtp --threads 1

Each family is built untrained at the target's shape (K = ``--block-size``, a ``--draft-vocab``-token draft
vocabulary, one layer where the family has a choice: the testbed's shapes) and bound to the target in each dtype.
After a prefill of ``--cache-len`` MT-Bench tokens it times, interleaved repeat by repeat with the target's 1-token
forward: the chain proposal (all K slots), the chain stopped after its first slot (``Chain(stop_below=...)`` with a
threshold no path clears: the least a confidence stop costs, for the families whose chain is a one-child tree; a
family that drafts its block in one call pays about its whole chain anyway), and, for a family that grows trees,
its 8-node tree. Untrained drafters accept nothing, so these are costs, not speedups: how many slots a confidence
stop saves depends on the trained drafter (``decode_speed.py --plan``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_speed import mt_bench_prompts  # this folder is on sys.path when the script runs
from lightning_spec import SamplingConfig, TreeConfig, load_target
from lightning_spec.decoding.engine import draft
from lightning_spec.decoding.plans import Chain
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters import FAMILIES
from objective_memory import cpu_name

SHAPES = {  # one decoder layer where a family takes a count; MTP's modules and SpecBlock's blocks likewise
    "dflash": {"num_layers": 1}, "dfly": {"num_layers": 1}, "dspark": {"num_layers": 1}, "domino": {"num_layers": 1},
    "d2sd": {"num_layers": 1}, "mtp": {"num_modules": 1}, "specblock": {"num_layers": 1, "blocks": 2},
    "peagle": {"mask_token_id": 1},  # any token: its embedding's values do not change the cost
    "dflash2": {"num_layers": 1, "selector_rank": 64},  # experiments/drafters/dflash2.yaml's selector
}


def build(family: str, target, k: int, draft_vocab: int, counts: torch.Tensor):
    torch.manual_seed(0)
    drafter = FAMILIES[family](block_size=k, draft_vocab_size=draft_vocab, **SHAPES.get(family, {}))
    drafter.bind(target)
    drafter.vocab.set_from_counts(counts.float() + torch.linspace(1, 0, target.vocab_size))  # ties broken by id
    return drafter.eval()


def costs(dtype: str, args) -> list[tuple]:
    """(dtype, family, target 1-token ms, chain ms, first-slot ms, 8-node tree ms or None) for every family."""
    greedy = SamplingConfig()
    target = load_target(args.target, dtype=dtype)
    prompts = mt_bench_prompts(target, 4, 0)
    flat = [t for p in prompts for t in p]
    ctx = (flat * (args.cache_len // len(flat) + 1))[: args.cache_len]
    counts = torch.bincount(torch.tensor(flat), minlength=target.vocab_size)
    ids = torch.tensor([ctx])
    cache = target.new_cache()
    target(ids[:, :-1], cache=cache, logits=False)
    past = cache.get_seq_length()
    anchor = ids[0, -1:]

    def one_token():
        target(anchor[None], cache=cache)
        target.crop(cache, past)

    fns = {"target": one_token}
    for family in args.families:
        drafter = build(family, target, args.block_size, min(args.draft_vocab, target.vocab_size), counts)
        out = target(ids[:, :-1], layers=list(drafter.target_layers), logits=False)
        state = drafter.begin(out.features, ids[:, :-1])
        fns[family, "chain"] = lambda d=drafter, s=state: draft(d, s, anchor, ctx, greedy, None)
        if drafter.tree_growth in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC):
            stop = Chain(stop_below=0.999999).resolve(drafter).tree  # slot 1's probability never clears it
            fns[family, "first slot"] = lambda d=drafter, s=state, t=stop: draft(d, s, anchor, ctx, greedy, t)
        if drafter.grows_trees:
            tree = TreeConfig(nodes=8, top_k=4)
            fns[family, "tree 8/4"] = lambda d=drafter, s=state, t=tree: draft(d, s, anchor, ctx, greedy, t)
    for fn in fns.values():  # warm-up
        fn()
    samples = {key: [] for key in fns}
    for _ in range(args.repeats):  # interleaved: a change of load hits every figure alike
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}
    return [(dtype, family, ms["target"], ms[family, "chain"], ms.get((family, "first slot")),
             ms.get((family, "tree 8/4"))) for family in args.families]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for dtype in args.dtypes for row in costs(dtype, args)]
    print(f"\ndraft_cost  target={args.target}  {cpu_name()}  threads={torch.get_num_threads()}  K={args.block_size}  "
          f"draft vocab {args.draft_vocab}  warm cache {args.cache_len} tokens, median of {args.repeats} (ms)")
    print(f"  {'dtype':<10}{'family':<11}{'target 1-token':>15}{'chain':>8}{'/ fwd':>7}{'stop at 1':>10}{'/ fwd':>7}"
          f"{'tree 8/4':>9}{'/ fwd':>7}")

    def cols(ms: float | None, fwd: float, width: int) -> str:
        return f"{ms:>{width}.1f}{ms / fwd:>6.0%} " if ms is not None else f"{'-':>{width}}{'':>7}"

    for dtype, family, fwd, chain, first, tree in rows:
        print(f"  {dtype:<10}{family:<11}{fwd:>15.1f}{cols(chain, fwd, 8)}{cols(first, fwd, 10)}{cols(tree, fwd, 9)}")


if __name__ == "__main__":
    main()
