"""Peak memory and step time of the objective over all anchors at once vs in chunks of anchors.

At ``experiments/qwen3_8b_ddp.yaml`` shapes (4 sequences x 512 anchors x 15 slots x a 32000-token draft
vocabulary) one fp32 copy of the logits is 3.9 GB, and KL needs two (draft and target) plus their softmaxes.
``DraftModule(loss_chunk=C)`` evaluates the objective C anchors at a time and recomputes each chunk's logits in
the backward pass. This script measures both at those shapes with a random stand-in for the drafter and the
target (only the hidden size is small: the logits, which dominate, have the real size):

    .venv/bin/python benchmarks/objective_memory.py                      # the Qwen3-8B DDP shapes
    .venv/bin/python benchmarks/objective_memory.py --anchors 64         # what fits unchunked on a laptop

Each side runs in its own process (peak resident memory is per process), with an address-space cap so that a
side that does not fit fails cleanly instead of swapping the machine. The loss and gradients of the two sides
are compared (they must agree within 1e-6 relative; ``tests/objectives/test_chunked.py`` holds that as a test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def cpu_name() -> str:
    """The CPU's model name and what tells this project's machines apart (a name such as "AMD EPYC" covers CPUs 4-5x
    apart): its family, its cores, and its widest bf16 path."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    isa = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else
           "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    return (f"{fields.get('model name', platform.processor() or 'unknown CPU')} (family {fields.get('cpu family', '?')}"
            f", {os.cpu_count()} cores, {isa})")


def run_side(args: argparse.Namespace, chunk: int | None) -> dict:
    """One step (forward + backward of the objective) in this process; its peak memory, time, loss, gradient."""
    import torch

    from lightning_spec.drafters import DraftOutput
    from lightning_spec.objectives import KL, ExpDecay, Objective, StepContext

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    n, a, k, v, h = args.batch, args.anchors, args.block, args.vocab, args.hidden
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = torch.randn(v, h) / h**0.5  # (Vd, H) the frozen head
    hidden = torch.randn(n, a, k, h, requires_grad=True)  # (N, A, K, H) the drafter's last states
    target_hidden = torch.randn(n, a, k, h)  # (N, A, K, H) the target's, at n + t - 1
    labels = torch.randint(0, v, (n, a, k))
    valid = torch.rand(n, a, k) < 0.9
    draft = DraftOutput(labels=labels, valid=valid, anchors=torch.zeros(n, a, dtype=torch.long), hidden=hidden,
                        head=lambda x, index: x @ head.t())
    ctx = StepContext(target_hidden=target_hidden, target_head=lambda x: x @ head.t())
    objective = Objective(KL(), ExpDecay(7.0))
    start = time.perf_counter()
    terms = objective(draft, ctx, chunk=chunk)
    terms.num.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "chunk": chunk, "seconds": seconds, "peak_gb": peak / 2**20, "setup_gb": before / 2**20,
        "loss": float(terms.value), "grad_norm": float(hidden.grad.norm()),
        "grad_sample": hidden.grad.flatten()[:: max(1, hidden.grad.numel() // 64)].tolist(),
    }


def spawn(args: argparse.Namespace, chunk: int | None) -> dict:
    """``run_side`` in a child process capped at ``--cap-gb`` of address space."""
    cmd = [sys.executable, __file__, "--child", "--chunk", str(chunk or 0)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "chunk", "chunks")
    ]
    cap = int(args.cap_gb * 2**30)
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # noqa: E731
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, env=os.environ.copy())
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"chunk": chunk, "error": reason[:160]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap-gb", type=float, default=16.0, help="address-space cap per side (GB)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_side(args, args.chunk or None)))
        return
    logits_gb = args.batch * args.anchors * args.block * args.vocab * 4 / 2**30
    print(f"{cpu_name()}, {args.threads} threads; N={args.batch} A={args.anchors} K={args.block} Vd={args.vocab} "
          f"(one fp32 logits copy {logits_gb:.2f} GB), KL + decay, cap {args.cap_gb:g} GB per side")
    sides = [spawn(args, None)] + [spawn(args, c) for c in args.chunks]
    base = sides[0]
    print(f"{'anchors per chunk':>18} {'peak GB':>8} {'step s':>7} {'loss':>12} {'max |Δgrad|/|grad|':>20}")
    for side in sides:
        label = "all" if side["chunk"] is None else str(side["chunk"])
        if "error" in side:
            print(f"{label:>18} {'—':>8} {'—':>7} {'did not fit: ' + side['error']}")
            continue
        diff = "—"
        if "error" not in base and side is not base:
            import torch

            a, b = torch.tensor(side["grad_sample"]), torch.tensor(base["grad_sample"])
            diff = f"{float((a - b).abs().max() / b.abs().max()):.1e}"
        print(f"{label:>18} {side['peak_gb']:8.2f} {side['seconds']:7.2f} {side['loss']:12.6f} {diff:>20}")


if __name__ == "__main__":
    main()
