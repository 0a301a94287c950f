"""The rollout worker's batching of streams (``act_together``): streams that act in one batch,
as the agent env's stages do when several wait at once, each get what they would alone."""

import numpy as np
import pytest
import torch

from embodied.config import build_policy
from embodied.workers.rollout import act_together
from tests.test_policies import make_cfg, make_obs


def as_channel_gives(obs):
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in obs.items()}


@pytest.mark.parametrize("model_type", ["mlp", "cnn"])
def test_each_stream_gets_what_it_would_get_alone(model_type):
    torch.manual_seed(0)
    policy = build_policy(make_cfg(model_type=model_type)).eval()
    streams = [as_channel_gives(make_obs(n, seed=n)) for n in (2, 3, 1)]
    with torch.no_grad():
        together = act_together(policy, streams, do_sample=False)
        alone = [act_together(policy, [obs], do_sample=False)[0] for obs in streams]
    assert len(together) == 3
    for mine, theirs, obs in zip(together, alone, streams):
        assert mine.actions.shape[0] == len(obs["states"]) and mine.token_mask is None
        for key in ("actions", "logprobs", "values"):
            torch.testing.assert_close(getattr(mine, key), getattr(theirs, key), rtol=1e-5, atol=1e-6)
        assert mine.forward_inputs.keys() == theirs.forward_inputs.keys()
        for key, value in mine.forward_inputs.items():
            torch.testing.assert_close(value, theirs.forward_inputs[key], rtol=1e-5, atol=1e-6)
    # the streams' rows are not interchangeable: a mix-up would show above
    assert not np.allclose(together[0].actions[0].numpy(), together[1].actions[0].numpy())
