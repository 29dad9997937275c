"""ReferenceModel(jit="step"): the whole step under one jax.jit (the benchmarks' speed baseline)
gives the per-layer jitted reference's logits and advances its caches the same way."""

import dataclasses

import numpy as np
import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model import load_model_config
from jalapeno_emu.model.reference import ReferenceModel
from jalapeno_emu.model.weights import init_weights


@pytest.mark.slow
def test_whole_step_jit_matches_the_per_layer_jit():
    # One layer and single-token steps only: one compiled shape per mode keeps this to seconds.
    cfg = dataclasses.replace(load_model_config("tiny-gpt-oss"), layers=1)
    w = init_weights(cfg, 0)
    per_layer = ReferenceModel(cfg, w, batch=1, max_positions=4, jit=True)
    step = ReferenceModel(cfg, w, batch=1, max_positions=4, jit="step")
    for tok in (3, 1, 4):  # later steps attend to the cached earlier ones
        want = per_layer.forward(np.array([[tok]]))
        got = step.forward(np.array([[tok]]))
        # XLA may fuse across layers differently from per layer: allow an FP32 ulp's effect
        # on a BF16 logit (one BF16 ulp), not more.
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * float(np.abs(want).max()))
    assert step.length == per_layer.length == 3


def test_an_unknown_jit_mode_is_refused():
    cfg = load_model_config("tiny-gpt-oss")
    with pytest.raises(InvalidArgumentError, match="jit="):
        ReferenceModel(cfg, init_weights(cfg, 0), batch=1, max_positions=4, jit="program")
