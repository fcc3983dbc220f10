"""txl's GTrXL in TorchRL (txl.rl.torchrl_module): a TorchRL user swaps it in for an LSTMModule. Collection in
sequential mode through TorchRL's own env.rollout (batched envs, InitTracker, the primer), then the recurrent mode
over the collected [B, T] data (what losses and GAE call) gives the same features, with gradients, and TorchRL's PPO
loss trains through it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")

from tensordict.nn import TensorDictModule as Mod  # noqa: E402
from tensordict.nn import TensorDictSequential as Seq  # noqa: E402
from torchrl.envs import GymEnv, InitTracker, SerialEnv, TransformedEnv  # noqa: E402
from torchrl.modules import OneHotCategorical, ProbabilisticActor, set_recurrent_mode  # noqa: E402
from torchrl.objectives import ClipPPOLoss  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402

from txl.rl.torchrl_module import GTrXLModule  # noqa: E402


def make_env():
    return TransformedEnv(GymEnv("CartPole-v1"), InitTracker())


def test_swap_for_an_lstm_module_and_replay_the_rollout():
    torch.manual_seed(0)
    env = SerialEnv(3, make_env)
    env.set_seed(3)
    # the TorchRL recipe with an LSTMModule, the memory swapped: these two lines
    memory = GTrXLModule(4, in_key="observation", out_key="features", d_model=16, n_layer=2, n_head=2, mem_len=6)
    env = TransformedEnv(env, memory.make_tensordict_primer())
    policy = Seq(memory, Mod(torch.nn.Linear(16, 2), in_keys=["features"], out_keys=["logits"]))
    actor = ProbabilisticActor(policy, in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True)
    with torch.no_grad():
        data = env.rollout(60, actor, break_when_any_done=False)  # [3, 60]
    assert data.shape == (3, 60)
    assert data["is_init"][:, 1:].any()  # (episodes ended and restarted within the rollout)
    assert not data["gtrxl_valid"][:, 0].any()  # (the primer's zeros: an empty memory)
    assert data["next", "gtrxl_valid"][:, 10].sum(-1).max() == 6  # (a full memory after mem_len steps)
    replay = data.clone().exclude("features", "logits")
    with set_recurrent_mode(True):
        replay = policy(replay)
    torch.testing.assert_close(replay["features"], data["features"], rtol=1e-5, atol=1e-5)
    valid = data["next", "gtrxl_valid"]
    assert torch.equal(replay["next", "gtrxl_valid"], valid)
    kept = valid[..., None, :, None]  # (a reset env's primer zeroes its memory; the replay leaves it, masked)
    torch.testing.assert_close(replay["next", "gtrxl_memory"] * kept, data["next", "gtrxl_memory"] * kept)
    # a change in an earlier episode changes nothing after the env's next reset
    b, t = (data["is_init"][..., 0] & (torch.arange(60) > 5)).nonzero()[0].tolist()
    changed = data.clone().exclude("features", "logits")
    changed["observation"][b, :t] += 1.0
    with set_recurrent_mode(True):
        changed = policy(changed)
    torch.testing.assert_close(changed["features"][b, t:], replay["features"][b, t:], rtol=0, atol=1e-6)
    assert (changed["features"][b, 1:t] - replay["features"][b, 1:t]).abs().max() > 1e-4

    # TorchRL's GAE and PPO loss, in recurrent mode, train the GTrXL's weights
    critic = Seq(memory, Mod(torch.nn.Linear(16, 1), in_keys=["features"], out_keys=["state_value"]))
    loss = ClipPPOLoss(actor, critic)
    with set_recurrent_mode(True):
        GAE(gamma=0.99, lmbda=0.95, value_network=critic, shifted=False)(data)
        losses = loss(data)
    total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
    total.backward()
    grads = [p.grad for p in memory.model.core.layers.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


def test_bad_state_gets_one_clear_error():
    memory = GTrXLModule(4, d_model=16, n_layer=1, n_head=2, mem_len=6)
    from tensordict import TensorDict

    td = TensorDict(
        {
            "observation": torch.zeros(2, 4),
            "is_init": torch.ones(2, 1, dtype=torch.bool),
            "gtrxl_memory": torch.zeros(2, 1, 5, 16),
            "gtrxl_valid": torch.zeros(2, 5, dtype=torch.bool),
        },
        batch_size=[2],
    )
    with pytest.raises(ValueError, match=r"'gtrxl_memory' must be \[\.\.\., 1, 6, 16\]"):
        memory(td)
    with pytest.raises(ValueError, match="needs input_size"):
        GTrXLModule(d_model=16)
