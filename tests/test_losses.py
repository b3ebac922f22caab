"""Each loss equals its formula from API.md, in value and in gradient."""

import math

import pytest
import torch

from mint import losses

torch.manual_seed(0)
N = 12
LP = torch.randn(N) - 2.0
Q = LP.detach() + 0.3 * torch.randn(N)
A = torch.randn(N)
W = torch.tensor([0.0] * 4 + [1.0] * 8)


def run(name, config=None, weights=W):
    spec, cfg = losses.resolve_loss(name, config)
    lp = LP.clone().requires_grad_(True)
    inputs = {"logprobs": Q, "advantages": A}
    if weights is not None:
        inputs["weights"] = weights
    loss = spec.fn(lp, inputs, cfg)
    loss.backward()
    return loss.detach(), lp.grad


def reference_grad(formula):
    lp = LP.clone().requires_grad_(True)
    formula(lp).backward()
    return lp.grad


def test_cross_entropy_is_negative_weighted_logprob_sum():
    loss, grad = run("cross_entropy")
    assert torch.allclose(loss, -(LP * W).sum())
    assert torch.allclose(grad, -W)


def test_importance_sampling_matches_formula():
    loss, grad = run("importance_sampling")
    ratio = torch.exp(LP - Q)
    assert torch.allclose(loss, -(ratio * A * W).sum())
    assert torch.allclose(grad, -(ratio * A * W), atol=1e-6)


def test_ppo_clips_the_ratio():
    loss, grad = run("ppo")
    expected = reference_grad(lambda lp: -(torch.minimum(torch.exp(lp - Q) * A,
                                                         torch.clamp(torch.exp(lp - Q), 0.8, 1.2) * A) * W).sum())
    ratio = torch.exp(LP - Q)
    assert torch.allclose(loss, -(torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A) * W).sum())
    assert torch.allclose(grad, expected, atol=1e-6)
    # Clipped tokens whose clipped term is the minimum get no gradient.
    clipped = ((ratio > 1.2) & (A > 0)) | ((ratio < 0.8) & (A < 0))
    assert torch.all(grad[clipped & (W > 0)] == 0)


def test_ppo_config_changes_thresholds():
    loss_wide, _ = run("ppo", {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0})
    loss_is, _ = run("importance_sampling")
    assert torch.allclose(loss_wide, loss_is)


def test_cispo_detaches_the_clipped_ratio():
    loss, grad = run("cispo")
    weight = torch.exp(LP - Q).clamp(0.0, 4.0)
    assert torch.allclose(loss, -(weight * LP * A * W).sum())
    assert torch.allclose(grad, -(weight * A * W), atol=1e-6)


def test_dro_default_beta_and_gradient():
    loss, grad = run("dro")
    beta = 0.05
    assert torch.allclose(loss, -((LP * A - 0.5 * beta * (LP - Q) ** 2) * W).sum())
    assert torch.allclose(grad, -(A - beta * (LP - Q)) * W, atol=1e-6)
    loss_b, _ = run("dro", {"beta": 0.5})
    assert not torch.allclose(loss, loss_b)


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_zero_weight_positions_contribute_nothing_even_with_absurd_inputs(name):
    spec, cfg = losses.resolve_loss(name, None)
    lp = LP.clone().requires_grad_(True)
    q = Q.clone()
    q[:4] = -1e4  # placeholder sampler logprobs on the prompt would overflow exp()
    loss = spec.fn(lp, {"logprobs": q, "advantages": A, "weights": W}, cfg)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert torch.all(lp.grad[:4] == 0)


def test_no_weights_means_every_position_counts():
    loss, _ = run("importance_sampling", weights=None)
    assert torch.allclose(loss, -(torch.exp(LP - Q) * A).sum())


def test_unknown_loss_and_config_key_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="loss_fn: unknown loss 'grpo'"):
        losses.resolve_loss("grpo", None)
    with pytest.raises(ValueError, match="loss_fn_config: unknown key 'beta' for loss 'ppo'"):
        losses.resolve_loss("ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match="clip_low_threshold"):
        losses.resolve_loss("ppo", {"clip_low_threshold": 2.0})
    with pytest.raises(ValueError, match=r"loss_fn_config\['beta'\] must be a finite number"):
        losses.resolve_loss("dro", {"beta": float("nan")})
