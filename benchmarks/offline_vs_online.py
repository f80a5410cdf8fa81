"""Offline MAL (exact expected rounds on target rollouts) vs the MAL of real sampled decoding, and what each costs.

    .venv/bin/python benchmarks/offline_vs_online.py --drafter runs/x/last.ckpt            # T=1, 8 prompts x 4
    .venv/bin/python benchmarks/offline_vs_online.py --drafter runs/x/last.ckpt --prompts 24 --samples 8 \\
        --rollouts rollouts/t1                                                             # keep the rollouts

On the same prompts (``select_prompts``: the selection ``lightning-spec rollouts`` makes), in one process:

  * rollouts: ``--samples`` responses per prompt sampled from the target under ``--temperature`` (plain
    decoding, ``generate_rollouts``); a one-off cost shared by every checkpoint scored on them;
  * offline: ``offline_report`` on those rollouts: exact expected rounds per rollout, MAL = Σ tokens / Σ rounds;
  * online: real speculative decoding of the same prompts, ``--samples`` seeded runs per prompt.

Both MALs get 95% bootstrap intervals over prompts (all samples of a prompt together), and their difference
(offline - online) an interval from the same resamples; the two estimate the same number, so that interval
should contain 0. The costs are wall seconds of the target + drafter work per checkpoint (offline: one
teacher-forced target forward per rollout + the drafter from every anchor; online: the decoding loop), their
ratio, and the number of checkpoints after which the rollouts have paid for themselves.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lightning_spec import SamplingConfig, generate, load_drafter, load_target
from lightning_spec.data.prompts import select_prompts
from lightning_spec.data.rollout_writer import Draw, generate_rollouts, rollout_seed
from lightning_spec.data.rollouts import load_rollout_set, load_rollouts
from lightning_spec.data.sources import as_source
from lightning_spec.evaluation.offline import offline_report
from lightning_spec.paired import compare


def untrained_drafter(target, block_size: int):
    from lightning_spec.drafters import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=block_size, num_layers=1)
    drafter.bind(target)
    return drafter.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="a fit checkpoint (.ckpt) or exported folder; default: untrained K=8")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--sources", nargs="+", default=["mt-bench", "humaneval", "mmath"])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per source")
    parser.add_argument("--samples", type=int, default=4, help="rollouts and online runs per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rollouts", help="rollouts folder to write or reuse (default: a temporary folder)")
    parser.add_argument("--batch-size", type=int, default=8, help="rollouts per batch (generation and offline)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target=target) if args.drafter else untrained_drafter(target, 8)
    label = args.drafter or "UNTRAINED DFlashDrafter(K=8)"
    sampling = SamplingConfig(temperature=args.temperature)
    prompts = select_prompts(target.tokenizer, [as_source(s) for s in args.sources], args.prompts, args.seed)

    # ---- rollouts (one-off, shared by every checkpoint)
    tmp = None
    folder = Path(args.rollouts) if args.rollouts else Path(tmp := tempfile.mkdtemp(prefix="rollouts-"))
    folder = folder if args.rollouts else folder / "r"
    reused = (folder / "rollouts.json").is_file()
    start = time.perf_counter()
    generate_rollouts(target, prompts, Draw(sampling, args.samples, args.max_new_tokens, seed=args.seed), folder,
                      batch_size=args.batch_size, sources=args.sources, progress=False)
    rollout_s = time.perf_counter() - start
    dataset, _ = load_rollouts(folder)

    # ---- offline
    warm = [(prompts[0]["prompt_ids"], dataset[0]["response_ids"][:8])]
    offline_report(target, drafter, warm, sampling)  # one-off kernel warm-up, not timed
    start = time.perf_counter()
    rollouts = load_rollout_set(folder)  # read once (its seconds count in the offline time, as they always did)
    read_s = time.perf_counter() - start
    report = offline_report(target, drafter, rollouts, batch_size=args.batch_size, progress=True)

    # ---- online: the same prompts, the same number of runs per prompt, rows in the rollouts' order
    generate(target, prompts[0]["prompt_ids"], 8, sampling, drafter=drafter, seed=0)  # warm-up
    by_id = {p["id"]: p for p in prompts}
    on_tok, on_rnd = [], []
    online_s = verify_s = draft_s = 0.0
    for row in dataset:
        p = by_id[row["prompt_id"]]
        seed = rollout_seed(args.seed + 1, p["id"], row["sample"])  # independent of the rollout's own draw
        gen = generate(target, p["prompt_ids"], args.max_new_tokens, sampling, drafter=drafter, seed=seed)
        on_tok.append(len(gen.tokens))
        on_rnd.append(gen.rounds)
        online_s += gen.seconds
        verify_s += gen.verify_seconds
        draft_s += gen.draft_seconds

    keys, domains = list(dataset["prompt_id"]), list(dataset["domain"])
    cmp = compare(
        {"online": np.asarray(on_rnd, float), "offline": report.rounds.numpy()},
        {"online": np.asarray(on_tok, float), "offline": report.tokens.numpy().astype(float)},
        keys, domains, baseline="online", n_resamples=args.resamples, seed=args.seed,
    )
    on, off = cmp.arm("online"), cmp.arm("offline")
    agree = off.delta_ci[0] <= 0 <= off.delta_ci[1]
    offline_s = read_s + report.seconds["total"]

    print(f"\noffline_vs_online  target={args.target}  drafter={label}  K={drafter.block_size}")
    print(f"  {len(prompts)} prompts x {args.samples} samples, T={args.temperature:g}, max_new_tokens="
          f"{args.max_new_tokens}, threads={torch.get_num_threads()}, "
          f"{sum(dataset['finished'])}/{len(dataset)} rollouts ended with EOS")
    print(f"\n  {'':<10}{'MAL':>8}{'95% CI (prompts)':>22}{'tokens':>9}{'rounds':>10}")
    print(f"  {'offline':<10}{off.mal:>8.3f}{f'[{off.mal_ci[0]:.3f}, {off.mal_ci[1]:.3f}]':>22}"
          f"{int(report.tokens.sum()):>9}{float(report.rounds.sum()):>10.1f}")
    print(f"  {'online':<10}{on.mal:>8.3f}{f'[{on.mal_ci[0]:.3f}, {on.mal_ci[1]:.3f}]':>22}"
          f"{sum(on_tok):>9}{sum(on_rnd):>10}")
    print(f"  offline - online = {off.delta:+.3f}, 95% CI [{off.delta_ci[0]:+.3f}, {off.delta_ci[1]:+.3f}] "
          f"-> {'agree (0 inside)' if agree else 'DISAGREE (0 outside)'}")
    width = (off.mal_ci[1] - off.mal_ci[0]) / max(on.mal_ci[1] - on.mal_ci[0], 1e-12)
    print(f"  offline CI width / online CI width = {width:.2f}")
    if len(cmp.by_domain) > 1:
        print(f"\n  {'domain':<10}{'offline':>9}{'online':>9}")
        for d, arms in cmp.by_domain.items():
            a = {x.name: x for x in arms}
            print(f"  {d:<10}{a['offline'].mal:>9.3f}{a['online'].mal:>9.3f}")
    print("\n  cost per checkpoint (wall seconds, same process)")
    print(f"  {'offline':<10}{offline_s:>8.1f} s   target forwards {report.seconds['target']:.1f} s, drafter "
          f"{report.seconds['drafter']:.1f} s, DP {report.seconds['dp']:.2f} s")
    print(f"  {'online':<10}{online_s:>8.1f} s   verify {verify_s:.1f} s, draft {draft_s:.1f} s")
    print(f"  online / offline = {online_s / max(offline_s, 1e-9):.1f}x")
    print(f"  rollouts (once, shared by every checkpoint): {rollout_s:.1f} s", end="")
    if reused:
        print(f" (reused {folder}: only missing rows were drawn)")
    elif online_s > offline_s:
        print(f"; paid back after {rollout_s / (online_s - offline_s):.1f} checkpoints")
    else:
        print()
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
