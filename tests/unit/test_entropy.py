"""The vocab-parallel entropy on one rank, against numbers computed by hand; ``actor.entropy_coef``
in the defaults. Several ranks: tests/distributed/test_entropy_tp.py."""

import math

import torch
import yaml
from torch.testing import assert_close

from hybridflow.algorithms import entropy_from_logits, vocab_parallel_entropy
from hybridflow.cli import main

LN2 = math.log(2)


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
                            [LN2, 0.0, 0.0, -1e4],  # p = (1/2, 1/4, 1/4, 0): 1/2 ln 2 + 2/4 ln 4
                            [1000.0, 1000.0, -1e4, -1e4]]])  # two equal, far from 0: ln 2
    expected = torch.tensor([[math.log(4), 1.5 * LN2, LN2]])
    # Exact to fp32 rounding even at large logits: the sums are taken below the max.
    assert_close(vocab_parallel_entropy(logits), expected, atol=1e-7, rtol=1e-7)


def test_entropy_gradient_hand_computed():
    # dH/dz_j = -p_j (log p_j + H); p = (1/2, 1/4, 1/4), H = 1.5 ln 2:
    # j = 0: -1/2 (-ln 2 + 1.5 ln 2) = -ln2 / 4; j = 1, 2: -1/4 (-2 ln 2 + 1.5 ln 2) = ln2 / 8.
    logits = torch.tensor([[[LN2, 0.0, 0.0]]], requires_grad=True)
    vocab_parallel_entropy(logits).sum().backward()
    assert_close(logits.grad, torch.tensor([[[-LN2 / 4, LN2 / 8, LN2 / 8]]]))


def test_entropy_gradient_equals_autograd_through_the_full_softmax():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=g)).requires_grad_()
    weight = torch.rand(2, 5, generator=g)
    ours = vocab_parallel_entropy(logits)
    (ours * weight).sum().backward()
    grad, logits.grad = logits.grad, None
    reference = entropy_from_logits(logits)
    (reference * weight).sum().backward()
    assert_close(ours, reference)
    assert_close(grad, logits.grad)


def test_entropy_is_computed_in_fp32():
    logits = torch.randn(1, 3, 8).bfloat16()
    out = vocab_parallel_entropy(logits)
    assert out.dtype == torch.float32
    assert_close(out, entropy_from_logits(logits.float()))


def test_entropy_coef_is_off_by_default_in_the_defaults(capsys):
    assert main(["defaults", "train"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["actor"]["entropy_coef"] == 0.0
