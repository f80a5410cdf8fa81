"""Plain vs speculative decoding speed on MT-Bench (or HumanEval, MMATH) prompts, and where the time goes. One
process, greedy.

    .venv/bin/python benchmarks/decode_speed.py                      # untrained DFlashDrafter (K=8), 8 prompts
    .venv/bin/python benchmarks/decode_speed.py --drafter runs/x.ckpt --threads 1
    .venv/bin/python benchmarks/decode_speed.py --breakdown          # + the 1-token vs (K+1)-token cost split
    .venv/bin/python benchmarks/decode_speed.py --no-peers           # without the transformers peers
    .venv/bin/python benchmarks/decode_speed.py --dtype bfloat16     # the target (and verify) in bf16
    .venv/bin/python benchmarks/decode_speed.py --drafter x.ckpt --plan '{kind: tree, nodes: 16, top_k: 4}'
    .venv/bin/python benchmarks/decode_speed.py --no-auto --ngram 0  # without decoding auto and the n-gram modes

Prints, on the same prompts and in the same process:
  * tokens/s of plain decoding (``generate(..., drafter=None)``) and of speculative decoding, their ratio, MAL;
  * the target forward time for 1 and for K+1 query tokens against a warm KV cache (median of ``--repeats``,
    the cache cropped back after every run), and the drafter's time per proposal;
  * engine efficiency = measured speculative tokens/s / (MAL / (draft + verify)): what the decoding loop
    (prefill, acceptance, cache bookkeeping, Python) loses outside the two forwards;
  * with ``--breakdown``: linear layers, LM head, attention and mask build for 1 vs K+1 query tokens;
  * every ``--plan`` (a decoding plan, ``decoding/plans.py``, as YAML; repeatable), interleaved with the chain and
    plain runs; the first of kind ``tree`` without n-gram nodes is *the* tree: its row also gives draft nodes per
    verify, and the forward times include its NODES + 1 query tokens under their ancestor mask;
  * n-gram lookup (``--ngram``, ``decoding/ngram.py``): alone as a chain, and with a tree plan as a trie and merged
    into the drafter's tree; and the setting decoding auto picks (``--auto``, ``decoding/auto/``) after
    calibrating on ``--calibration`` other prompts: one table of every mode with MAL, tokens/s over plain, whether
    the output equals plain decoding's, and engine efficiency (the tokens/s the measured draft and verify times
    allow round by round, over the measured); every table says whether the dtype keeps greedy identity;
  * the peers a user would try instead (``--peers``, on by default), interleaved prompt by prompt with the
    runs above: transformers' ``model.generate`` on the same target model, greedy with ``use_cache``: plain,
    prompt-lookup decoding (``prompt_lookup_num_tokens``) and assisted generation (``assistant_model``: the
    target's first ``--assistant-layers`` decoder layers with its embeddings, final norm and LM head, no
    training); tokens/s and ratios to transformers' plain decoding and to lightning_spec's plain decoding.

Without ``--drafter`` the drafter is an UNTRAINED ``DFlashDrafter(block_size=8, num_layers=1,
draft_vocab_size=4096)`` whose draft vocabulary comes from arbitrary counts (the prompts' own tokens): its MAL
is ~1, so it measures the machinery, not a speedup. On a machine shared with another job pass
``--threads 1``: OpenMP threads that have to wait for a busy core make every timing erratic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import yaml

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, load_target
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.decoding.plans import Auto, Chain, Ngram, Plain, Tree, parse_plan
from lightning_spec.target import dtype_name


class Timings:
    """Wall-time samples per named function. ``run`` times every function once per repeat, interleaved, and
    can be called several times (between prompts): a change of load on the machine hits every figure alike."""

    def __init__(self, fns: dict, warmup: int = 2) -> None:
        self.fns = fns
        self.samples: dict = {name: [] for name in fns}
        self.run(warmup, keep=False)

    def run(self, repeats: int, keep: bool = True) -> None:
        for _ in range(repeats):
            for name, fn in self.fns.items():
                synchronize()
                start = time.perf_counter()
                fn()
                synchronize()
                if keep:
                    self.samples[name].append(time.perf_counter() - start)

    def medians_ms(self) -> dict:
        return {name: 1e3 * statistics.median(ts) for name, ts in self.samples.items()}


def median_ms(fns: dict, repeats: int) -> dict:
    timings = Timings(fns)
    timings.run(repeats)
    return timings.medians_ms()


def mt_bench_prompts(target, count: int, seed: int, source: str = "mt-bench") -> list[list[int]]:
    """``count`` MT-Bench first-turn prompts, round-robin over its 8 categories, chat-templated (or those of
    another packaged ``source``: humaneval, mmath)."""
    data = SpecDataModule(
        target=target.name,
        train_sources=["sharegpt"],  # required by the constructor, never read: only eval prompts are built
        eval_sources=[source],
        eval_prompts_per_domain=count,
        seed=seed,
        tokenizer=target.tokenizer,
        target_options=target.options,  # its chat-template arguments (e.g. Qwen3's enable_thinking)
    )
    return [p["prompt_ids"] for p in data.eval_prompts()][:count]


def untrained_drafter(target, block_size: int, prompts: list[list[int]]):
    from lightning_spec.drafters import DFlashDrafter

    drafter = DFlashDrafter(block_size=block_size, num_layers=1, draft_vocab_size=min(4096, target.vocab_size))
    drafter.bind(target)
    counts = torch.bincount(torch.tensor([t for p in prompts for t in p]), minlength=target.vocab_size)
    drafter.vocab.set_from_counts(counts.float() + torch.linspace(1, 0, target.vocab_size))  # ties broken by token id
    return drafter.eval()


def context_ids(prompts: list[list[int]], length: int) -> torch.Tensor:
    """``length`` real tokens (the prompts concatenated, repeated if short) for the warm cache: (1, length)."""
    flat = [t for p in prompts for t in p]
    flat = (flat * (length // max(len(flat), 1) + 1))[:length]
    return torch.tensor([flat])


def synchronize() -> None:
    """Wait for queued GPU work before reading the clock (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def forward_timings(target, drafter, ctx: torch.Tensor, tree: TreeConfig | None = None) -> Timings:
    """Timers of: the plain step (1 token), the verify forward (K+1 tokens with the drafter's feature layers)
    and one drafter proposal, all against a warm cache of ``ctx``, cropped back after every run; with ``tree``
    also the tree's proposal and its verify forward (its nodes under the ancestor mask)."""
    k, layers = drafter.block_size, list(drafter.target_layers)
    cache = target.new_cache()
    out = target(ctx, layers=layers, cache=cache, logits=False)
    past = cache.get_seq_length()
    gen = torch.Generator().manual_seed(0)
    one = torch.randint(0, target.vocab_size, (1, 1), generator=gen).to(target.device)
    block = torch.randint(0, target.vocab_size, (1, k + 1), generator=gen).to(target.device)

    def step(ids, lay, positions=None, mask=None):
        target(ids, layers=lay, cache=cache, positions=positions, tree_mask=mask)
        target.crop(cache, past)

    state = drafter.begin(out.features, ctx)
    anchor = one[0]
    greedy = SamplingConfig()
    fns = {
        "target_1": lambda: step(one, []),
        "target_k1": lambda: step(block, layers),
        "draft": lambda: drafter.propose(state, anchor, greedy),
    }
    if tree is not None:
        nodes, depth, mask = drafter.propose_tree(state, anchor, greedy, tree).verify_inputs(anchor)
        fns["target_tree"] = lambda: step(nodes[None], layers, depth, mask)
        fns["draft_tree"] = lambda: drafter.propose_tree(state, anchor, greedy, tree)
    return Timings(fns)


def breakdown(target, ctx: torch.Tensor, q_lens: list[int], repeats: int) -> list[tuple[str, list[float]]]:
    """Per-forward cost of each part of transformers' forward for every query length in ``q_lens`` (ms, medians),
    Llama-style targets (the whole forward on a ``DynamicCache``, which runs transformers' forward).

    Linear layers and the LM head are the real weights called with fresh activations, every layer in turn
    (so weights stream from memory as in a forward); attention is the model's configured attention function
    on the real KV cache shapes; mask is ``create_causal_mask`` against the real cache.
    """
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    F = torch.nn.functional
    cfg = target.config
    layers = target.base.layers
    linears = [m.weight for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    attn = layers[0].self_attn
    attention = ALL_ATTENTION_FUNCTIONS[cfg._attn_implementation]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cache = target.new_cache(dynamic=True)
    target(ctx, cache=cache, logits=False)
    past = cache.get_seq_length()
    fns: dict[tuple[str, int], Callable[[], object]] = {}
    for q in q_lens:
        x = {w.shape[1]: torch.randn(q, w.shape[1]) for w in linears}
        hidden = torch.randn(q, target.hidden_size)
        emb = torch.randn(1, q, target.hidden_size)
        pos = torch.arange(past, past + q)[None]
        mask = create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=None, cache=cache, position_ids=pos)
        query = torch.randn(1, heads, q, head_dim)
        kv = [
            (torch.randn(1, kv_heads, past + q, head_dim), torch.randn(1, kv_heads, past + q, head_dim)) for _ in layers
        ]
        ids = torch.randint(0, target.vocab_size, (1, q))

        def whole(ids=ids):
            target(ids, cache=cache)
            target.crop(cache, past)

        fns["whole forward (with logits)", q] = whole
        fns[f"linear layers ({len(linears)} matmuls)", q] = lambda x=x: [F.linear(x[w.shape[1]], w) for w in linears]
        fns["LM head", q] = lambda hidden=hidden: F.linear(hidden, target.lm_head.weight)

        def attend(query=query, kv=kv, mask=mask):
            return [attention(attn, query, k, v, mask, dropout=0.0, scaling=attn.scaling) for k, v in kv]

        fns[f"attention ({cfg._attn_implementation}, {len(layers)} layers)", q] = attend
        fns["mask build", q] = lambda emb=emb, pos=pos: create_causal_mask(
            config=cfg, inputs_embeds=emb, attention_mask=None, cache=cache, position_ids=pos
        )
    ms = median_ms(fns, repeats)
    names = list(dict.fromkeys(name for name, _ in fns))
    rows = [(name, [ms[name, q] for q in q_lens]) for name in names]
    rest = [ms[names[0], q] - sum(ms[name, q] for name in names[1:]) for q in q_lens]
    return rows + [("rest (norms, RoPE, cache, Python)", rest)]


# ------------------------------------------------------------------------------ n-gram modes and decoding auto
def exactness(target) -> str:
    """The mode statement every speed table carries (``Target.precision``): greedy identity holds in fp32 only."""
    return target.precision


def our_modes(target, drafter, tree, calibration, args) -> tuple[dict, dict, dict, object]:
    """name -> the decoding plan (``decoding/plans.py``) of each ``--plan``, the n-gram modes and decoding auto's pick
    (calibrated on ``calibration``); name -> the target's dtype it decodes in (None: ``--dtype``; auto's pick and,
    when it searched dtypes, plain decoding in the dtype it found fastest); the measured costs (``auto.Costs``) of
    those and of plain, the chain and the tree (after a context made of those prompts) per dtype (None: ``--dtype``);
    and auto's ``Choice`` (None without ``--auto``)."""
    from lightning_spec.decoding.auto import choose_decoding, measure_costs

    modes, dtypes, choice = {}, {}, None
    for value in args.plan:
        plan = parse_plan(yaml.safe_load(value))
        plan.resolve(drafter)  # refused here, in one sentence, if the drafter cannot run it
        if tree is None or Tree.of(tree) != plan:  # the tree has its own row
            modes[plan.label] = plan
    if args.ngram:
        modes[f"n-gram lookup (K={args.ngram})"] = Ngram(length=args.ngram)
        if tree is not None:
            modes[f"n-gram trie ({tree.nodes} nodes, top {tree.top_k})"] = Ngram(args.ngram, tree.nodes, tree.top_k)
            ngram = max(2, tree.nodes // 4)
            modes[f"tree + n-gram ({ngram} of {tree.nodes} nodes)"] = Tree(tree.nodes, tree.top_k, tree.depth, ngram)
    if args.auto:
        searched = "native" if args.auto_dtypes == ["native"] else args.auto_dtypes
        choice = choose_decoding(target, drafter, calibration, max_new_tokens=args.max_new_tokens, progress=True,
                                 auto=Auto(dtypes=searched))
        print(choice.table())
        own = dtype_name(target.dtype)
        if choice.plain_dtype not in (None, own):  # the fastest plain decoding is in another dtype: a row of its own
            modes[f"plain {choice.plain_dtype}"] = Plain()
            dtypes[f"plain {choice.plain_dtype}"] = choice.plain_dtype
        name = f"auto: {choice.plan.label}" + (f", {choice.dtype}" if choice.dtype != own else "")
        modes[name] = choice.plan
        dtypes[name] = choice.dtype if choice.dtype != own else None
    context = context_ids(calibration, args.cache_len)[0].tolist()
    costs = {None: measure_costs(target, drafter, list(base_settings(tree).values()) + list(modes.values()), context)}
    for dtype in set(dtypes.values()) - {None}:
        costs[dtype] = measure_costs(target.cast(dtype), drafter, list(modes.values()), context)
    drafter.use_target(target)
    return modes, dtypes, costs, choice


def base_settings(tree) -> dict:
    """The rows decode_speed always decodes (plain, the chain, the tree) as decoding plans."""
    return {"plain": Plain(), "chain": Chain(), **({"tree": Tree.of(tree)} if tree else {})}


def ideal_seconds(costs, plan, out) -> float:
    """The seconds ``out``'s rounds take by the measured draft and verify times alone."""
    return sum(costs.draft[plan] + costs.verify_seconds(1 + n, plan.verifies_tree) for n in out.draft_lengths)


# ------------------------------------------------------------------------------ transformers' own decoders
def first_layers_assistant(target, num_layers: int):
    """A draft model cut from the target: its first ``num_layers`` decoder layers plus its embeddings, final
    norm and LM head (the target's weights, untrained), for transformers' assisted generation."""
    import copy

    cfg = copy.deepcopy(target.model.config)
    if not 0 < num_layers < cfg.num_hidden_layers:
        raise ValueError(f"--assistant-layers must be in 1..{cfg.num_hidden_layers - 1}, got {num_layers}.")
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    model = type(target.model)(cfg).to(target.device)
    missing, _ = model.load_state_dict(target.model.state_dict(), strict=False)  # layers >= n are dropped
    if set(missing) - {"lm_head.weight"}:  # lm_head.weight is absent from the state dict when tied
        raise RuntimeError(f"the assistant lacks target weights for {missing}")
    model.generation_config = copy.deepcopy(target.model.generation_config)
    return model.eval().requires_grad_(False)


def hf_generate(model, ids: list[int], max_new_tokens: int, **kwargs) -> tuple[list[int], float]:
    """transformers' greedy ``generate`` with the KV cache: (new tokens, EOS included if generated; seconds)."""
    x = torch.tensor([ids], device=model.device)
    start = time.perf_counter()
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                         do_sample=False, use_cache=True, **kwargs)
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def hf_peers(target, args) -> dict[str, Callable[[list[int]], tuple[list[int], float]]]:
    """name -> run(prompt ids) for transformers' plain, prompt-lookup and assisted decoding of the target."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-flag notices, once per call
    model = target.model
    eos = target.eos_token_ids
    common = {"eos_token_id": eos, "pad_token_id": eos[0] if eos else 0}
    assistant = first_layers_assistant(target, args.assistant_layers)
    return {
        "transformers generate (plain)": lambda ids: hf_generate(model, ids, args.max_new_tokens, **common),
        f"transformers prompt lookup (n={args.lookup_tokens})": lambda ids: hf_generate(
            model, ids, args.max_new_tokens, prompt_lookup_num_tokens=args.lookup_tokens, **common
        ),
        f"transformers assisted ({args.assistant_layers}-layer cut)": lambda ids: hf_generate(
            model, ids, args.max_new_tokens, assistant_model=assistant, **common
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="a fit checkpoint (.ckpt) or exported folder; default: untrained")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (the drafter keeps its weights)")
    parser.add_argument("--device", default="cpu", help="where the target and drafter run: cpu, cuda, cuda:1, ...")
    parser.add_argument("--decode", default="fast", help="the target's decoding forward: fast, transformers")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (round-robin over the source's categories)")
    parser.add_argument("--source", default="mt-bench", help="the prompts' source: mt-bench, humaneval or mmath")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, help="K; default 8 untrained, the checkpoint's otherwise")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--repeats", type=int, default=20, help="repeats per forward timing (median)")
    parser.add_argument("--cache-len", type=int, default=200, help="warm-cache length for the forward timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--breakdown", action="store_true", help="also split 1 vs K+1 token forwards by part")
    parser.add_argument("--plan", action="append", default=[],
                        help="also decode with this decoding plan, YAML (repeatable): e.g. "
                             "'{kind: chain, stop_below: 0.2}' or '{kind: tree, nodes: 16, top_k: 4, ngram: 4}'; "
                             "the first tree without n-gram nodes is also timed as a forward and drives the n-gram "
                             "trie modes")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="also time transformers' generate: plain, prompt lookup, assisted")
    parser.add_argument("--assistant-layers", type=int, default=2, help="decoder layers of the assisted peer")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of that peer")
    parser.add_argument("--ngram", type=int, default=10,
                        help="also decode with our n-gram lookup of this many tokens (0: not); with a tree --plan "
                             "also an n-gram trie and the tree with a quarter of its nodes offered to n-gram "
                             "candidates")
    parser.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                        help="also decode with the setting decoding auto picks (choose_decoding), calibrated on "
                             "--calibration other prompts of --source")
    parser.add_argument("--calibration", type=int, default=4, help="calibration prompts for --auto")
    parser.add_argument("--auto-dtypes", nargs="+",
                        help="the target's dtypes --auto searches: 'native' (float32, and bfloat16 where this CPU or "
                             "GPU multiplies it natively) or names (default: --dtype alone); a pick or a fastest "
                             "plain decoding in another dtype decodes there, in a row of its own")
    parser.add_argument("--json", help="also write the table of every mode to this JSON file (benchmarks/testbed.py)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype=args.dtype, device=args.device, decode=args.decode)
    everything = mt_bench_prompts(target, args.prompts + (args.calibration if args.auto else 0), args.seed,
                                  args.source)
    prompts, calibration = everything[: args.prompts], everything[args.prompts :]
    if args.drafter:
        drafter = load_drafter(args.drafter, target=target)
        label = f"{type(drafter).__name__} from {args.drafter}"
        if args.block_size:
            drafter.block_size = args.block_size
    else:
        drafter = untrained_drafter(target, args.block_size or 8, prompts)
        label = "UNTRAINED DFlashDrafter(num_layers=1, draft_vocab_size=4096)"
    k = drafter.block_size
    greedy = SamplingConfig()
    trees = [p for p in map(parse_plan, map(yaml.safe_load, args.plan)) if isinstance(p, Tree) and not p.ngram]
    tree = trees[0].config if trees else None

    # warm-up: both paths, every kernel shape the loop uses
    for d in (None, drafter):
        generate(target, prompts[0], 8, greedy, drafter=d)
    if tree is not None:
        generate(target, prompts[0], 8, greedy, drafter=drafter, plan=tree)
    peers = hf_peers(target, args) if args.peers else {}
    for run in peers.values():
        run(prompts[0][:16])
    peer_tokens = {name: 0 for name in peers}
    peer_s = {name: 0.0 for name in peers}
    peer_same = {name: 0 for name in peers}
    modes, mode_dtypes, mode_costs, choice = our_modes(target, drafter, tree, calibration or prompts, args)
    costs = mode_costs[None]

    def target_of(name):  # the target a mode decodes with: in its dtype
        return target.cast(mode_dtypes[name]) if mode_dtypes.get(name) else target

    for name, plan in modes.items():
        generate(target_of(name), prompts[0], 8, greedy, drafter=drafter, plan=plan)
    mode_sums = {name: [0, 0, 0.0, 0, 0.0] for name in modes}  # tokens, rounds, seconds, same, ideal seconds
    base_ideal = dict.fromkeys(base_settings(tree), 0.0)  # ideal seconds of plain, the chain and the tree

    ctx = context_ids(prompts, args.cache_len).to(target.device)
    timings = forward_timings(target, drafter, ctx, tree)
    per_prompt = -(-args.repeats // len(prompts))  # the forward timings run between the prompts

    plain_tokens = spec_tokens = rounds = 0
    plain_s = spec_s = draft_s = verify_s = prefill_s = 0.0
    same = 0
    tree_tokens = tree_rounds = tree_nodes = tree_same = 0
    tree_s = 0.0
    for ids in prompts:  # plain, speculative and the forward timings interleaved: load changes hit all alike
        plain = generate(target, ids, args.max_new_tokens, greedy, drafter=None)
        spec = generate(target, ids, args.max_new_tokens, greedy, drafter=drafter)
        plain_tokens, plain_s = plain_tokens + len(plain.tokens), plain_s + plain.seconds
        spec_tokens, spec_s, rounds = spec_tokens + len(spec.tokens), spec_s + spec.seconds, rounds + spec.rounds
        draft_s, verify_s = draft_s + spec.draft_seconds, verify_s + spec.verify_seconds
        same += plain.tokens == spec.tokens
        if tree is not None:
            grown = generate(target, ids, args.max_new_tokens, greedy, drafter=drafter, plan=tree)
            tree_tokens, tree_rounds = tree_tokens + len(grown.tokens), tree_rounds + grown.rounds
            tree_s += grown.seconds
            tree_nodes += sum(grown.draft_lengths)
            tree_same += plain.tokens == grown.tokens
        for name, plan in modes.items():
            out = generate(target_of(name), ids, args.max_new_tokens, greedy, drafter=drafter, plan=plan)
            sums = mode_sums[name]
            sums[0], sums[1], sums[2] = sums[0] + len(out.tokens), sums[1] + out.rounds, sums[2] + out.seconds
            sums[3] += out.tokens == plain.tokens
            sums[4] += ideal_seconds(mode_costs[mode_dtypes.get(name)], plan, out)
        drafter.use_target(target)
        base = base_settings(tree)
        for name, out in (("plain", plain), ("chain", spec), *([("tree", grown)] if tree is not None else [])):
            base_ideal[name] += ideal_seconds(costs, base[name], out)
        # the prompt's prefill alone, to split the loop's own overhead from it (in no figure above)
        synchronize()
        start = time.perf_counter()
        target(torch.tensor([ids[:-1]], device=target.device), layers=list(drafter.target_layers),
               cache=target.new_cache(), logits=False)
        synchronize()
        prefill_s += time.perf_counter() - start
        for name, run in peers.items():
            tokens, seconds = run(ids)
            peer_tokens[name] += len(tokens)
            peer_s[name] += seconds
            peer_same[name] += tokens == plain.tokens
        timings.run(per_prompt)
    t = timings.medians_ms()
    repeats = len(timings.samples["draft"])

    mal = spec_tokens / max(rounds, 1)
    plain_tps, spec_tps = plain_tokens / plain_s, spec_tokens / spec_s
    ideal_spec = mal / ((t["draft"] + t["target_k1"]) / 1e3)
    ideal_plain = 1 / (t["target_1"] / 1e3)
    other_s = spec_s - draft_s - verify_s - prefill_s

    print(f"\ndecode_speed  target={args.target}  drafter={label}  K={k}")
    from lightning_spec.decoding.auto import machine_name

    print(
        f"  {len(prompts)} {args.source} prompts, greedy, max_new_tokens={args.max_new_tokens}, "
        f"threads={torch.get_num_threads()}, torch {torch.__version__}, {machine_name(target.device)}, "
        f"{exactness(target)}"
    )
    print(f"\n  {'':<24}{'tokens':>8}{'rounds':>8}{'MAL':>7}{'seconds':>9}{'tokens/s':>10}")
    print(
        f"  {'plain (drafter=None)':<24}{plain_tokens:>8}{plain_tokens:>8}{1.0:>7.2f}{plain_s:>9.2f}{plain_tps:>10.2f}"
    )
    print(f"  {f'speculative (K={k})':<24}{spec_tokens:>8}{rounds:>8}{mal:>7.2f}{spec_s:>9.2f}{spec_tps:>10.2f}")
    if tree is not None:
        tree_mal, tree_tps = tree_tokens / max(tree_rounds, 1), tree_tokens / tree_s
        name = f"tree ({tree.nodes} nodes, top {tree.top_k})"
        print(f"  {name:<24}{tree_tokens:>8}{tree_rounds:>8}{tree_mal:>7.2f}{tree_s:>9.2f}{tree_tps:>10.2f}")
    print(
        f"  speculative / plain tokens/s = {spec_tps / plain_tps:.2f}x   "
        f"greedy outputs identical on {same}/{len(prompts)} prompts"
    )
    if tree is not None:
        print(
            f"  tree / plain tokens/s = {tree_tps / plain_tps:.2f}x   tree / chain = {tree_tps / spec_tps:.2f}x   "
            f"{tree_nodes / max(tree_rounds, 1):.1f} draft nodes per verify (chain: {k})   "
            f"greedy outputs identical on {tree_same}/{len(prompts)} prompts"
        )
    if peers:
        rows = [(name, peer_tokens[name], peer_s[name], peer_same[name]) for name in peers]
        rows += [("lightning_spec plain", plain_tokens, plain_s, len(prompts)),
                 (f"lightning_spec speculative (K={k})", spec_tokens, spec_s, same)]
        hf_tps = peer_tokens[next(iter(peers))] / max(peer_s[next(iter(peers))], 1e-9)
        print("\n  side by side, same prompts, interleaved prompt by prompt (greedy, KV cache)")
        print(f"  {'':<40}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'/ HF plain':>12}{'/ ls plain':>12}"
              f"{'same tokens':>13}")
        for name, tokens, seconds, equal in rows:
            tps = tokens / max(seconds, 1e-9)
            print(f"  {name:<40}{tokens:>8}{seconds:>9.2f}{tps:>10.2f}{tps / hf_tps:>11.2f}x{tps / plain_tps:>11.2f}x"
                  f"{f'{equal}/{len(prompts)}':>13}")
        print("  same tokens = output identical to lightning_spec plain decoding")
    # every mode in one table, each row's efficiency from the same measured costs
    print(f"\n  every mode of our engine, same prompts, interleaved ({exactness(target)})")
    print(f"  {'':<44}{'tokens':>8}{'rounds':>8}{'MAL':>7}{'tokens/s':>10}{'/ plain':>9}{'same tokens':>13}"
          f"{'efficiency':>12}")
    rows = [("plain", plain_tokens, plain_tokens, plain_s, len(prompts), base_ideal["plain"]),
            (f"chain (K={k})", spec_tokens, rounds, spec_s, same, base_ideal["chain"])]
    if tree is not None:
        rows.append((f"tree ({tree.nodes} nodes, top {tree.top_k})", tree_tokens, tree_rounds, tree_s, tree_same,
                     base_ideal["tree"]))
    rows += [(name, *sums[:4], sums[4]) for name, sums in mode_sums.items()]
    table = []
    for name, tokens, n_rounds, seconds, equal, ideal in rows:
        tps = tokens / max(seconds, 1e-9)
        table.append({"mode": name, "tokens": tokens, "rounds": n_rounds, "mal": tokens / max(n_rounds, 1),
                      "tokens_per_s": tps, "vs_plain": tps / plain_tps, "same": equal, "prompts": len(prompts)})
        eff = f"{(ideal + prefill_s) / seconds:>12.0%}"
        print(f"  {name:<44}{tokens:>8}{n_rounds:>8}{tokens / max(n_rounds, 1):>7.2f}{tps:>10.2f}"
              f"{tps / plain_tps:>8.2f}x{f'{equal}/{len(prompts)}':>13}{eff}")
    print("  efficiency = measured tokens/s over those the measured prefill, draft and verify times allow, "
          "round by round (what the loop itself costs)")
    if choice is not None:
        sums = next(mode_sums[name] for name in modes if name.startswith("auto: "))
        fastest = mode_sums.get(f"plain {choice.plain_dtype}")  # the baseline auto judged against, when not ours
        base_tps = fastest[0] / fastest[2] if fastest else plain_tps
        print("  " + choice.describe((sums[0] / sums[2]) / base_tps, sums[0] / sums[2]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "drafter": label, "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens, "modes": table}, f, indent=2)
    print(f"\n  forward times, warm cache of {ctx.shape[1]} tokens, median of {repeats} (ms)")
    print(f"  {'target, 1 query token':<38}{t['target_1']:>8.1f}")
    print(
        f"  {f'target, K+1={k + 1} query tokens (verify)':<38}{t['target_k1']:>8.1f}"
        f"   {t['target_k1'] / t['target_1']:.2f}x the 1-token forward"
    )
    print(f"  {'drafter, one proposal':<38}{t['draft']:>8.1f}")
    if tree is not None:
        print(
            f"  {f'target, tree of {tree.nodes}+1 tokens (verify)':<38}{t['target_tree']:>8.1f}"
            f"   {t['target_tree'] / t['target_1']:.2f}x the 1-token forward"
        )
        print(f"  {'drafter, one tree proposal':<38}{t['draft_tree']:>8.1f}")
    print(f"  {'break-even MAL (draft+verify)/step':<38}{(t['draft'] + t['target_k1']) / t['target_1']:>8.2f}")
    print("\n  engine efficiency = measured tokens/s / ideal tokens/s from the forward times above")
    print(f"  {'':<38}{'ideal':>8}{'measured':>10}{'efficiency':>12}")
    print(
        f"  {'speculative: MAL / (draft + verify)':<38}{ideal_spec:>8.2f}{spec_tps:>10.2f}"
        f"{spec_tps / ideal_spec:>12.0%}"
    )
    print(
        f"  {'plain: 1 / (1-token forward)':<38}{ideal_plain:>8.2f}{plain_tps:>10.2f}{plain_tps / ideal_plain:>12.0%}"
    )
    print(
        f"  speculative wall time: draft {draft_s / spec_s:.0%}, verify {verify_s / spec_s:.0%}, "
        f"prefill {prefill_s / spec_s:.0%}, rest of the loop {other_s / spec_s:.0%}"
    )
    print(
        f"  in the loop, per round: draft {1e3 * draft_s / rounds:.1f} ms, verify {1e3 * verify_s / rounds:.1f} ms "
        f"(contexts of {min(map(len, prompts))}..{max(map(len, prompts)) + args.max_new_tokens} tokens)"
    )

    if args.breakdown:
        q_lens = [1, k + 1]
        rows = breakdown(target, ctx, q_lens, args.repeats)
        print(f"\n  per-forward cost by part, warm cache of {ctx.shape[1]} tokens, median of {args.repeats} (ms)")
        print(f"  {'part':<46}" + "".join(f"{f'q={q}':>9}" for q in q_lens) + f"{'delta':>9}")
        for name, ms in rows:
            print(f"  {name:<46}" + "".join(f"{m:>9.1f}" for m in ms) + f"{ms[-1] - ms[0]:>+9.1f}")


if __name__ == "__main__":
    main()
