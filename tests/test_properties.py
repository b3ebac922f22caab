"""Property-based tests (hypothesis): any well-formed loss input gives a finite loss equal to the
formula of API.md, and any malformed datum is refused with the field named, leaving the training
client's weights, gradients and optimizer state as they were."""

import pytest
import torch
from conftest import EMBEDDED, grads_snapshot, lora_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mint import losses, types

finite = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False, width=32)


@st.composite
def policy_inputs(draw):
    n = draw(st.integers(min_value=1, max_value=40))
    vectors = [draw(st.lists(strategy, min_size=n, max_size=n)) for strategy in (
        finite, finite, st.floats(-5, 5, width=32), st.sampled_from([0.0, 0.5, 1.0]))]
    return [torch.tensor(v, dtype=torch.float32) for v in vectors]


def _formula(name: str, lp, q, a, w, cfg) -> torch.Tensor:
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(ratio * a * w).sum()
    if name == "ppo":
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -(torch.minimum(ratio * a, clipped * a) * w).sum()
    if name == "cispo":
        return -(ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * lp * a * w).sum()
    return -(lp * w).sum()  # cross_entropy


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "cross_entropy"])
@settings(max_examples=60, deadline=None)
@given(inputs=policy_inputs())
def test_well_formed_inputs_give_the_formulas_finite_loss(name, inputs):
    lp, q, a, w = inputs
    spec, cfg = losses.resolve_loss(name, None)
    loss = spec.fn(lp.clone().requires_grad_(True), {"logprobs": q, "advantages": a, "weights": w}, cfg)
    assert torch.isfinite(loss)
    assert torch.allclose(loss.detach(), _formula(name, lp, q, a, w, cfg), rtol=1e-4, atol=1e-3)


@st.composite
def malformed_datums(draw):
    """A datum with exactly one thing wrong, and the words its error must contain."""
    n = draw(st.integers(min_value=1, max_value=12))
    inputs = {"target_tokens": [1] * n, "logprobs": [-1.0] * n, "advantages": [0.5] * n, "weights": [1.0] * n}
    fault = draw(st.sampled_from(["length", "nan", "missing", "unknown", "token"]))
    field = draw(st.sampled_from(["logprobs", "advantages", "weights"]))
    if fault == "length":
        inputs[field] = inputs[field] + [0.0] * draw(st.integers(1, 3))
        expect = field
    elif fault == "nan":
        inputs[field][draw(st.integers(0, n - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
        expect = field
    elif fault == "missing":
        field = draw(st.sampled_from(["logprobs", "advantages"]))
        del inputs[field]
        expect = field
    elif fault == "unknown":
        inputs["advantage"] = [0.0] * n
        expect = "advantage"
    else:
        inputs["target_tokens"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, 10**7]))
        expect = "target_tokens"
    return types.Datum(model_input=types.ModelInput.from_ints([1] * n), loss_fn_inputs=inputs), expect


@pytest.fixture(scope="module")
def client(service):
    return service.create_lora_training_client(EMBEDDED, rank=4, seed=0)


@pytest.mark.model
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=malformed_datums())
def test_a_malformed_datum_is_refused_naming_the_field_and_changes_nothing(client, case):
    datum, field = case
    weights, grads = lora_snapshot(client), grads_snapshot(client)
    with pytest.raises((ValueError, TypeError)) as error:
        client.forward_backward([datum], "importance_sampling").result()
    assert field in str(error.value)
    assert all(torch.equal(weights[k], v) for k, v in lora_snapshot(client).items())
    assert grads_snapshot(client).keys() == grads.keys()
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(grads.values(), grads_snapshot(client).values()))


def _bounded_fields() -> list[tuple[str, float | None, float | None, type]]:
    """(name, lowest allowed, highest allowed, type) of every numeric GRPOConfig field with bounds."""
    import annotated_types

    from flows.config import GRPOConfig

    fields = []
    for name, info in GRPOConfig.model_fields.items():
        if info.annotation not in (int, float):
            continue
        low = next((m.ge if isinstance(m, annotated_types.Ge) else m.gt for m in info.metadata
                    if isinstance(m, (annotated_types.Ge, annotated_types.Gt))), None)
        high = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
        fields.append((name, low, high, info.annotation))
    return fields


BOUNDED = _bounded_fields()


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_config_values_out_of_bounds_or_of_the_wrong_type_are_refused_naming_the_field(data):
    from pydantic import ValidationError

    from flows.config import GRPOConfig

    name, low, high, kind = data.draw(st.sampled_from(BOUNDED))
    number = st.integers if kind is int else (lambda **k: st.floats(allow_nan=False, allow_infinity=False, **k))
    choices = [st.just("not a number"), st.just([1, 2])]
    if low is not None:
        choices.append(number(max_value=low - 1, min_value=low - 10**9))
    if high is not None:
        choices.append(number(min_value=high + 1, max_value=high + 10**12))
    value = data.draw(st.one_of(choices))
    with pytest.raises(ValidationError) as error:
        GRPOConfig.model_validate({name: value})
    assert name in str(error.value)


@settings(max_examples=30, deadline=None)
@given(key=st.from_regex(r"[a-z][a-z_]{2,20}", fullmatch=True))
def test_an_unknown_config_key_is_refused_naming_it(key):
    from pydantic import ValidationError

    from flows.config import GRPOConfig

    if key in GRPOConfig.model_fields:
        return
    with pytest.raises(ValidationError, match=key):
        GRPOConfig.model_validate({key: 1})
