"""One drafter decoded with and without its adaptive length head (AdaFlash, Qian et al. 2026, arXiv 2607.19223).

    .venv/bin/python benchmarks/length_head.py --drafter runs/x/last.ckpt --threads 1   # a drafter with length_head
    .venv/bin/python benchmarks/length_head.py                       # untrained DFlashDrafter (K=8): the machinery only
    .venv/bin/python benchmarks/length_head.py --drafter x.ckpt --temperature 1.0 --length-rate 1.0

Prints, on the same MT-Bench prompts and in the same process, the runs interleaved prompt by prompt (their order
alternating from prompt to prompt, so warm-up and load changes hit both alike):
  * speculative decoding with the head (a round submits k = clamp(round(pred * K * length_rate), length_min, K)
    draft tokens) and without it (``drafter.use_length_head = False``: K tokens every round), and plain decoding
    (``--plain``, on by default): tokens, rounds, MAL, draft tokens per round, seconds, tokens/s;
  * the with / without ratios of tokens/s and MAL, how often each cut k was chosen, and under greedy decoding on how
    many prompts each output equals plain decoding (all: both are lossless).

The head pays off when verifying fewer tokens saves more than the shorter blocks lose in MAL: on a target whose
verify forward costs about the same for 1 and K + 1 tokens (a large model on a GPU) it can only lose MAL; on a
2-core CPU, where a K + 1 token forward costs ~1.8x a 1-token one (benchmarks/README.md), it can win.

Without ``--drafter`` the drafter is an UNTRAINED ``DFlashDrafter(block_size=8, num_layers=1, draft_vocab_size=4096,
length_head=True)``: MAL ~1 and a head predicting ~0.5, so it measures the machinery, not a speedup. On a machine
shared with another job pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from decode_speed import mt_bench_prompts  # benchmarks/ is on sys.path when a script here runs
from lightning_spec import SamplingConfig, generate, load_drafter, load_target


def untrained_drafter(target, block_size: int, prompts: list[list[int]]):
    from lightning_spec.drafters import DFlashDrafter

    drafter = DFlashDrafter(block_size=block_size, num_layers=1, draft_vocab_size=min(4096, target.vocab_size),
                           length_head=True)
    drafter.bind(target)
    counts = torch.bincount(torch.tensor([t for p in prompts for t in p]), minlength=target.vocab_size)
    drafter.vocab.set_from_counts(counts.float() + torch.linspace(1, 0, target.vocab_size))  # ties broken by token id
    return drafter.eval()


class Tally:
    """Sums over the prompts of one decoding setting."""

    def __init__(self) -> None:
        self.tokens = self.rounds = self.drafted = self.same = 0
        self.seconds = 0.0
        self.cuts: Counter = Counter()

    def add(self, gen, plain_tokens: list[int] | None) -> None:
        self.tokens += len(gen.tokens)
        self.rounds += gen.rounds
        self.drafted += sum(gen.draft_lengths)
        self.seconds += gen.seconds
        self.cuts.update(gen.draft_lengths)
        self.same += plain_tokens is not None and gen.tokens == plain_tokens

    @property
    def mal(self) -> float:
        return self.tokens / max(self.rounds, 1)

    @property
    def tps(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="a fit checkpoint (.ckpt) or exported folder of a drafter with length_head")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (the drafter keeps its weights)")
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench prompts (round-robin over categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8, help="K of the untrained drafter (no --drafter)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs compared with plain)")
    parser.add_argument("--length-rate", type=float, help="override the drafter's length_rate (AdaFlash: 1.3)")
    parser.add_argument("--length-min", type=int, help="override the drafter's length_min")
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                        help="also decode without a drafter")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype=args.dtype)
    prompts = mt_bench_prompts(target, args.prompts, args.seed)
    if args.drafter:
        drafter = load_drafter(args.drafter, target=target)
        label = f"{type(drafter).__name__} from {args.drafter}"
        if not getattr(drafter, "length_head", False):
            parser.error(f"--drafter {args.drafter} has no length head; train one with "
                         "model.drafter.init_args.length_head: true (experiments/regimes/length_head_init.yaml).")
    else:
        drafter = untrained_drafter(target, args.block_size, prompts)
        label = "UNTRAINED DFlashDrafter(num_layers=1, draft_vocab_size=4096, length_head=True)"
    if args.length_rate is not None:
        drafter.length_rate = args.length_rate
    if args.length_min is not None:
        drafter.length_min = args.length_min
    k = drafter.block_size
    sampling = SamplingConfig(temperature=args.temperature)

    def decode(ids: list[int], head: bool | None, seed: int):
        if head is not None:
            drafter.use_length_head = head
        return generate(target, ids, args.max_new_tokens, sampling, drafter=drafter if head is not None else None,
                        seed=seed)

    for head in (True, False, None):  # warm-up: every path and kernel shape the loop uses
        decode(prompts[0], head, args.seed)
    runs = {"with the head": Tally(), "without (K every round)": Tally()}
    plain = Tally()
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        seed = args.seed + i
        reference = decode(ids, None, seed) if args.plain else None
        if reference is not None:
            plain.add(reference, reference.tokens)
        order = [(True, "with the head"), (False, "without (K every round)")]
        for head, name in order if i % 2 == 0 else order[::-1]:
            runs[name].add(decode(ids, head, seed), reference.tokens if reference is not None else None)
    drafter.use_length_head = True
    wall = time.perf_counter() - start

    greedy = sampling.greedy
    print(f"\nlength_head  target={args.target}  drafter={label}  K={k}  length_rate={drafter.length_rate}  "
          f"length_min={drafter.length_min}")
    print(f"  {len(prompts)} MT-Bench prompts, temperature={args.temperature}, max_new_tokens={args.max_new_tokens}, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, {wall:.1f} s in all")
    print(f"\n  {'':<26}{'tokens':>8}{'rounds':>8}{'MAL':>7}{'drafts/round':>14}{'seconds':>9}{'tokens/s':>10}"
          + (f"{'same as plain':>15}" if greedy and args.plain else ""))
    rows = ([("plain (drafter=None)", plain)] if args.plain else []) + list(runs.items())
    for name, t in rows:
        same = f"{t.same}/{len(prompts)}" if greedy and args.plain else ""
        print(f"  {name:<26}{t.tokens:>8}{t.rounds:>8}{t.mal:>7.2f}{t.drafted / max(t.rounds, 1):>14.2f}"
              f"{t.seconds:>9.2f}{t.tps:>10.2f}{same:>15}")
    cut, full = runs["with the head"], runs["without (K every round)"]
    print(f"\n  with / without the head: tokens/s {cut.tps / full.tps:.2f}x   MAL {cut.mal / full.mal:.2f}x   "
          f"draft tokens per round {cut.drafted / max(cut.rounds, 1):.2f} vs {k}")
    if args.plain:
        print(f"  speculative / plain tokens/s: with the head {cut.tps / plain.tps:.2f}x, "
              f"without {full.tps / plain.tps:.2f}x")
    print("  cuts chosen by the head (k: rounds): " + ", ".join(f"{n}: {c}" for n, c in sorted(cut.cuts.items())))


if __name__ == "__main__":
    main()
