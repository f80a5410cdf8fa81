"""How far stored features are from the fp32 target's: fp16 storage of fp32 features (the default store), and features
computed in bf16 (``model.feature_dtype: auto`` on CPUs and GPUs with native bf16), stored in bf16.

    .venv/bin/python benchmarks/feature_agreement.py                    # 8 quickstart training examples

One batch of the quickstart's training data through SmolLM2-135M in fp32 and in bf16. For each way of storing it
prints the relative error of the context features and of the final hidden state (‖Δ‖ / ‖fp32‖ over the batch's real
tokens), the worst cosine similarity of a token's feature vector to fp32's, the target distribution's KL(p_fp32 ‖
p_stored) per position through the LM head, and what one training step of the quickstart's drafter sees: its loss
and the relative error of its gradient against the step on fp32 features.
"""

from __future__ import annotations

import argparse

import torch

from objective_memory import cpu_name  # this folder is on sys.path when the script runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=8)
    args = parser.parse_args()

    from lightning_spec.datamodule import SpecDataModule
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.loaders import collate
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import KL, ExpDecay, Objective, StepContext
    from lightning_spec.objectives.context import slot_hidden

    torch.manual_seed(0)
    module = DraftModule(DFlashDrafter(block_size=8, num_layers=1, num_anchors=32, context_shortcut=True),
                         Objective(KL(), ExpDecay(2.0)), target="smollm2-135m-instruct", feature_dtype="bfloat16")
    dm = SpecDataModule(target="smollm2-135m-instruct", train_sources=["sharegpt"], train_limit=200, max_length=160,
                        eval_sources=[])
    dm.setup("fit")
    batch = collate([dm.train_dataset[i] for i in range(args.examples)], dm.pad_id)
    real = batch["attention_mask"].bool()  # (N, S)
    layers = module.drafter.target_layers
    exact = module.target(batch["input_ids"], layers=layers, logits=False)
    bf16 = module.feature_source.target(batch["input_ids"], layers=layers, logits=False)
    ways = {
        "fp32 computed, fp16 stored (default)": (exact.features.half().float(), exact.last_hidden.half().float()),
        "bf16 computed, bf16 stored (feature_dtype: auto)": (bf16.features.float(), bf16.last_hidden.float()),
    }
    head = module.target.lm_head
    p = torch.log_softmax(head(exact.last_hidden[real]), -1)  # (T, V) fp32 target distribution

    def step(features: torch.Tensor, last: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        module.drafter.zero_grad(set_to_none=True)
        seeded = module.seeded(batch, 0)
        draft = module.drafter(seeded, features)
        ctx = StepContext(target_hidden=slot_hidden(draft.anchors, draft.block_size, last),
                          target_head=module.target_head)
        terms = module.objective(draft, ctx)
        terms.num.backward()
        return float(terms.num.detach() / terms.den), {k: q.grad.clone() for k, q in module.drafter.named_parameters()
                                                       if q.grad is not None}

    loss0, grads0 = step(exact.features, exact.last_hidden)
    print(f"CPU: {cpu_name()}; {args.examples} ShareGPT examples ({int(real.sum())} tokens), layers {layers}")
    print(f"fp32 features: drafter loss {loss0:.5f}")
    for name, (features, last) in ways.items():
        f_err = float((features - exact.features)[real].norm() / exact.features[real].norm())
        h_err = float((last - exact.last_hidden)[real].norm() / exact.last_hidden[real].norm())
        cos = float(torch.nn.functional.cosine_similarity(features[real], exact.features[real], dim=-1).min())
        q = torch.log_softmax(head(last[real]), -1)
        kl = float((p.exp() * (p - q)).sum(-1).mean())
        loss, grads = step(features, last)
        g_err = max(float((grads[k] - g).norm() / g.norm().clamp_min(1e-12)) for k, g in grads0.items())
        print(f"{name}:\n  features rel. error {f_err:.2e}, final hidden rel. error {h_err:.2e}, worst token cosine "
              f"{cos:.6f}\n  KL(p_fp32 || p_stored) per position {kl:.2e} nats; drafter loss {loss:.5f} "
              f"({loss / loss0 - 1:+.2e}); worst parameter's gradient rel. error {g_err:.2e}")


if __name__ == "__main__":
    main()
