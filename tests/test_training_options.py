"""actor.optim / actor.fsdp_config keys do what they say (optimizer choice, min_lr, precision,
CPU offload, gradient checkpointing), and keys that cannot work here are refused by name."""

from __future__ import annotations


import pytest
import torch
from omegaconf import OmegaConf

from embodied.cli import load
from embodied.config import ConfigError, compose
from embodied.training_options import autocast, build_optimizer, fsdp_options, grad_scaler
from embodied.config import schema
from embodied.config.refused import REFUSED, refusal, refuse_unsupported
from embodied.config import build_policy
from tests.runs import on_two_gloo_ranks


def optim_cfg(**changes):
    return compose("maniskill_ppo_mlp", [f"actor.optim.{k}={v}" for k, v in changes.items()]).actor.optim


def one_step(name: str, grad: float, **changes) -> float:
    """The parameter (1.0) after one step with this gradient."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = build_optimizer([{"params": [p]}], optim_cfg(optimizer=name, lr=0.1, **changes))
    p.grad = torch.full((1,), grad)
    opt.step()
    return p.item()


def test_optimizer_choice_and_weight_decay():
    # SGD: p - lr * (g + wd * p)
    assert one_step("sgd", 0.5, weight_decay=0.2) == pytest.approx(1 - 0.1 * (0.5 + 0.2))
    # AdamW decouples the decay: a zero gradient still shrinks p by lr * wd * p
    assert one_step("adamw", 0.0, weight_decay=0.2) == pytest.approx(1 - 0.1 * 0.2)
    # Adam adds wd * p to the gradient: the first step moves by lr whatever the scale
    assert one_step("adam", 0.0, weight_decay=0.2) == pytest.approx(1 - 0.1, rel=1e-4)
    opt = build_optimizer([{"params": [torch.nn.Parameter(torch.ones(1))]}],
                          optim_cfg(optimizer="adamw", adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6))
    assert opt.defaults["betas"] == (0.8, 0.99) and opt.defaults["eps"] == 1e-6
    with pytest.raises(ConfigError, match="actor.optim.adam_beta2: not supported with actor.optim.optimizer=sgd"):
        load("maniskill_ppo_mlp", ["actor.optim.optimizer=sgd", "actor.optim.adam_beta2=0.9"])
    with pytest.raises(ConfigError, match=r"actor.optim.optimizer = 'lion': expected one of \['adam', 'adamw', 'sgd'\]"):
        load("maniskill_ppo_mlp", ["actor.optim.optimizer=lion"])


def test_min_lr_of_optim_is_the_schedules_default_and_the_schedule_overrides_it():
    assert compose("maniskill_ppo_mlp", ["actor.optim.min_lr=1e-5"]).actor.lr_sched.min_lr == 1e-5
    both = compose("maniskill_ppo_mlp", ["actor.optim.min_lr=1e-5", "actor.lr_sched.min_lr=2e-5"])
    assert both.actor.lr_sched.min_lr == 2e-5
    with pytest.raises(ConfigError, match=r"actor.lr_sched.min_lr = 0.1: expected at most actor.lr_sched.max_lr \(0.0003\)"):
        load("maniskill_ppo_mlp", ["actor.optim.min_lr=0.1"])


def test_precision_and_offload_options():
    fsdp = compose("maniskill_ppo_mlp", [
        "actor.fsdp_config.mixed_precision.param_dtype=bf16", "actor.fsdp_config.cpu_offload=true",
        "actor.fsdp_config.amp_autocast.enabled=true", "actor.fsdp_config.reshard_after_forward=false",
    ]).actor.fsdp_config
    options = fsdp_options(fsdp)
    assert options["reshard_after_forward"] is False
    assert options["mp_policy"].param_dtype == torch.bfloat16 and options["mp_policy"].reduce_dtype == torch.float32
    assert options["offload_policy"].pin_memory is False
    with autocast(fsdp, torch.device("cpu"))():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    plain = compose("maniskill_ppo_mlp").actor.fsdp_config
    assert fsdp_options(plain) == {"reshard_after_forward": True}
    with autocast(plain, torch.device("cpu"))():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    for overrides, match in [
        (["actor.fsdp_config.grad_scaler.enabled=true"], "grad_scaler.enabled: not supported here, because"),
        (["actor.fsdp_config.offload_pin_memory=true"], "offload_pin_memory: not supported here, because pinned"),
        (["actor.fsdp_config.cpu_offload=true", "actor.enable_offload=true"],
         "actor.enable_offload: not supported with actor.fsdp_config.cpu_offload"),
        (["actor.fsdp_config.cpu_offload=true", "actor.offload_weight=true"],
         "actor.offload_weight: not supported with actor.fsdp_config.cpu_offload"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load("maniskill_ppo_mlp", overrides)


FP16 = ["actor.fsdp_config.amp_autocast.enabled=true", "actor.fsdp_config.amp_autocast.precision=fp16",
        "actor.fsdp_config.grad_scaler.enabled=true"]


def _fp16_rank(rank: int, results) -> None:
    from torch.distributed.fsdp import fully_shard

    fsdp, cpu = load("maniskill_ppo_mlp", FP16)[0].actor.fsdp_config, torch.device("cpu")  # validated
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    fully_shard(layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler, forward = grad_scaler(fsdp, cpu), autocast(fsdp, cpu)
    moved = []
    for step in range(2):
        with forward():
            out = layer(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
        scaler.scale(out.float().square().mean()).backward()
        if step == 1 and rank == 1:  # an overflow in one rank's shard only
            layer.weight.grad.to_local().fill_(float("inf"))
        before = layer.weight.full_tensor().clone()
        scaler.step(optimizer)
        scaler.update()
        moved.append(not torch.equal(before, layer.weight.full_tensor()))
        optimizer.zero_grad()
    results[rank] = (out.dtype, moved, scaler.get_scale())


@pytest.mark.slow
def test_fp16_autocast_with_loss_scaling_runs_on_cpu_and_an_overflow_on_one_rank_skips_the_step_on_both():
    """fp16 autocast and torch's GradScaler on the CPU (FSDP2 on two gloo ranks): the forward pass
    computes in fp16, a clean step moves the weights, an inf in one rank's gradient shard skips the
    next step on every rank (the weights stay identical across ranks) and halves the scale."""
    init = compose("maniskill_ppo_mlp").actor.fsdp_config.grad_scaler.init_scale
    assert on_two_gloo_ranks(_fp16_rank) == {rank: (torch.float16, [True, False], init / 2) for rank in (0, 1)}


def _sharding_rank(rank: int, results) -> None:
    from torch.distributed.fsdp import fully_shard

    from embodied.training_options import fsdp_mesh

    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        fsdp = load("maniskill_ppo_mlp", [f"actor.fsdp_config.sharding_strategy={strategy}"])[0].actor.fsdp_config
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 2)
        fully_shard(layer, **fsdp_options(fsdp, fsdp_mesh(fsdp, torch.device("cpu"))))
        held = tuple(layer.weight.to_local().shape)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own samples
        layer(x).square().mean().backward()
        optimizer.step()
        results[(rank, strategy)] = (held, *(p.full_tensor().detach().clone() for p in (layer.weight, layer.bias)))


@pytest.mark.slow
def test_sharding_strategies_hold_what_they_say_and_train_the_same():
    """Two gloo ranks, each on its own samples: full_shard and shard_grad_op hold half the weight
    matrix per rank, no_shard all of it; one AdamW step gives every rank and every strategy the
    weights of one process stepping on the mean gradient of both ranks' losses."""
    results = on_two_gloo_ranks(_sharding_rank)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    losses = [layer(torch.randn(3, 4, generator=torch.Generator().manual_seed(r))).square().mean() for r in (0, 1)]
    (sum(losses) / 2).backward()
    optimizer.step()
    for (rank, strategy), (held, weight, bias) in results.items():
        assert held == ((2, 4) if strategy == "no_shard" else (1, 4)), (rank, strategy)
        torch.testing.assert_close(weight, layer.weight.detach())
        torch.testing.assert_close(bias, layer.bias.detach())
    assert fsdp_options(compose("maniskill_ppo_mlp", ["actor.fsdp_config.sharding_strategy=shard_grad_op"])
                        .actor.fsdp_config)["reshard_after_forward"] is False
    with pytest.raises(ConfigError, match="actor.fsdp_config.sharding_strategy: not supported: hybrid_shard"):
        load("maniskill_ppo_mlp", ["actor.fsdp_config.sharding_strategy=hybrid_shard"])


def test_gradient_checkpointing_recomputes_the_trunks_and_keeps_the_gradients():
    cfg = compose("maniskill_ppo_mlp").actor.model
    torch.manual_seed(0)
    plain = build_policy(cfg)
    checked = build_policy(cfg)
    checked.load_state_dict(plain.state_dict())
    stacks = checked.enable_gradient_checkpointing()
    assert len(stacks) == 2  # the actor's and the critic's trunks
    calls = []
    for stack in stacks:
        stack[0].register_forward_hook(lambda *_: calls.append(1))
    inputs = {"states": torch.randn(5, cfg.state_dim)}
    actions = plain.act(inputs).actions
    grads = []
    for policy in (plain, checked):
        out = policy.evaluate(policy.preprocess(inputs), actions)
        (out.logprobs.sum() + out.values.sum()).backward()
        grads.append({n: p.grad for n, p in policy.named_parameters()})
    assert len(calls) == 4  # each trunk ran again in the backward pass
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad)


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "x"  # strings and nulls


def test_the_refused_keys_are_keys_of_the_schema():
    leaves = schema.leaves()
    assert [key for key in REFUSED if not any(k == key or k.startswith(key + ".") for k in leaves)] == []


@pytest.mark.slow
@pytest.mark.parametrize("config,model_type", [("maniskill_ppo_mlp", "mlp"), ("maniskill_ppo_openvla_oft", "openvla_oft")])
def test_each_refused_key_stops_the_command_naming_it(config, model_type):
    """Every leaf that the table refuses, set to another value than its default."""
    base = OmegaConf.to_container(compose(config))
    refuse_unsupported(OmegaConf.create(base))  # the defaults pass
    leaves = schema.leaves(model_type)
    for path in [k for k in leaves if refusal(k)]:
        node = leaves[path].default
        cfg = OmegaConf.create(base)
        OmegaConf.update(cfg, path, _other_value(None if isinstance(node, str) and "${" in node else node))
        with pytest.raises(ConfigError) as info:
            refuse_unsupported(cfg)
        message = str(info.value)
        assert message.startswith(f"{path}: not supported: ") and ", because " in message, message


@pytest.mark.slow
def test_refusal_is_one_line_and_exit_code_2():
    from tests.runs import embodied

    _, done = embodied("train", ["actor.optim.bf16=true"], code=2)
    assert done.stderr.strip().splitlines() == [
        "embodied-train: config error: actor.optim.bf16: not supported here, because actor.training_backend fsdp "
        "does not read it (megatron does: by the actor: mixed precision: fp32 main weights of the bf16 model "
        "(actor.model.precision bf16), no loss scale)"]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_run_with_every_option_on_trains_on_two_fsdp2_ranks(tmp_path):
    """AdamW with weight decay, bf16 autocast and bf16 FSDP2 parameters, CPU offload, gradient
    checkpointing, a linear decay to optim.min_lr, and max_ckpts_to_keep=1, through the real
    workers (the actor on two gloo ranks)."""
    from embodied import checkpoint
    from tests.runs import embodied, tiny_config
    from tests.test_pipeline import scalars

    embodied("train", tiny_config(tmp_path) + [
        f"runner.output_dir={tmp_path}", "runner.max_epochs=3", "runner.max_ckpts_to_keep=1",
        "actor.optim.optimizer=adamw", "actor.optim.weight_decay=0.01", "actor.optim.min_lr=1e-5",
        "actor.lr_sched.lr_decay_style=linear", "actor.fsdp_config.amp_autocast.enabled=true",
        "actor.fsdp_config.mixed_precision.param_dtype=bf16", "actor.fsdp_config.cpu_offload=true",
        "actor.model.gradient_checkpointing=true"])
    logs = tmp_path / "tiny"
    assert scalars(logs, "actor/lr") == pytest.approx({1: 3e-4, 2: (3e-4 + 1e-5) / 2, 3: 1e-5})
    for tag in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm"):
        assert all(torch.isfinite(torch.tensor(v)) for v in scalars(logs, tag).values()), tag
    assert scalars(logs, "actor/skipped_updates") == {1: 0.0, 2: 0.0, 3: 0.0}
    ckpts = checkpoint.list_checkpoints(logs / "checkpoints")
    assert [p.name for p in ckpts] == ["global_step_3"]
    weights = torch.load(ckpts[0] / "actor" / "model.pt", weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_critic_warmup_trains_only_the_critic_for_its_steps(tmp_path):
    """``algorithm.critic_warmup: 2``: the checkpoints of steps 1 and 2 hold the same actor and
    different critics; step 3 moves the actor (through the real workers, actor on two ranks)."""
    from embodied import checkpoint
    from tests.runs import embodied, tiny_config
    from tests.test_pipeline import scalars

    embodied("train", tiny_config(tmp_path) + [f"runner.output_dir={tmp_path}", "runner.max_epochs=3",
                                               "algorithm.critic_warmup=2"])
    steps = [torch.load(p / "actor" / "model.pt", weights_only=True)
             for p in checkpoint.list_checkpoints(tmp_path / "tiny" / "checkpoints")]
    assert len(steps) == 3

    def moved(a: dict, b: dict, critic: bool) -> bool:
        names = [k for k in a if k.startswith("value_head.") == critic]
        assert names
        return any(not torch.equal(a[k], b[k]) for k in names)

    assert not moved(steps[0], steps[1], critic=False) and moved(steps[0], steps[1], critic=True)
    assert moved(steps[1], steps[2], critic=False) and moved(steps[1], steps[2], critic=True)
    logs = tmp_path / "tiny"
    assert set(scalars(logs, "critic/value_loss")) == {1, 2, 3}
    assert set(scalars(logs, "actor/policy_loss")) == {3}  # no policy loss while the critic warms up



def test_shuffle_rollout_draws_minibatches_shuffled_or_in_the_rollouts_order():
    from embodied.workers.actor import _minibatches

    ordered = [m.tolist() for m in _minibatches(10, 4, 2, torch.Generator().manual_seed(0), shuffle=False)]
    assert ordered == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2  # the partial last minibatch dropped
    shuffled = [m.tolist() for m in _minibatches(10, 4, 2, torch.Generator().manual_seed(0), shuffle=True)]
    assert len(shuffled) == 4 and shuffled != ordered
    for first, second in (shuffled[:2], shuffled[2:]):  # within a pass, no sample twice
        assert len(set(first) | set(second)) == 8
    again = [m.tolist() for m in _minibatches(10, 4, 2, torch.Generator().manual_seed(0))]
    assert again == shuffled  # shuffling stays the default, seeded as before
