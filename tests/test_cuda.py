"""The same guarantees on a CUDA device (skipped where there is none; CI has none).

Written after a run on a lent H200 found that seeded sampling broke on CUDA: the engine's generators live on
the CPU (one seed, the same draws everywhere) and ``SamplingConfig.sample`` passed one to a CUDA multinomial.
"""

import pytest
import torch

from lightning_spec import SamplingConfig, generate, load_target
from lightning_spec.drafters import DFlashDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_target():
    return load_target("tiny-random", device="cuda")


def test_greedy_speculative_equals_plain_on_cuda(cuda_target):
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=4, num_layers=1)
    drafter.bind(cuda_target)
    prompt = torch.randint(0, 256, (1, 12))
    plain = generate(cuda_target, prompt, 24)
    spec = generate(cuda_target, prompt, 24, drafter=drafter)
    assert spec.tokens == plain.tokens


def test_seeded_sampling_runs_and_repeats_on_cuda(cuda_target):
    drafter = DFlashDrafter(block_size=4, num_layers=1)
    drafter.bind(cuda_target)
    prompt = torch.randint(0, 256, (1, 12))
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    first = generate(cuda_target, prompt, 16, sampling, drafter=drafter, seed=3)
    again = generate(cuda_target, prompt, 16, sampling, drafter=drafter, seed=3)
    assert first.tokens == again.tokens
    assert SamplingConfig(temperature=1.0).sample(torch.full((2, 5), 0.2, device="cuda"),
                                                  torch.Generator().manual_seed(0)).device.type == "cuda"
