"""The schema's invariants: every key is read by the code that declares it or refused with a
reason; allowed values are declared once, next to the default, and enforced; every declared
choice is implemented; keys only some models, heads or envs read are refused elsewhere."""

from __future__ import annotations

import ast
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from core.registry import load
from embodied.config import refused, schema, validate
from embodied.backends import BACKENDS, rollout_options
from embodied.config import ConfigError, compose
from embodied.config.schema import CONFIG_DIR
from embodied.config.schema import Rule, RuleError, parse_rule
from policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for d in ("embodied", "envs", "policies") for p in sorted((ROOT / d).rglob("*.py"))]
MODEL_TYPES = POLICIES.names()


# ----------------------------------------------------------------------------- rules
def test_rules_parse_from_comments():
    assert parse_rule(" {adam, adamw, sgd} adam = L2").choices == ("adam", "adamw", "sgd")
    assert parse_rule("{1, 2}: images").choices == (1, 2)
    rule = parse_rule("(0, inf) or null: clip")
    assert rule.allows(0.1) and rule.allows(None) and not rule.allows(0) and not rule.allows(-1)
    rule = parse_rule("[1, inf) or -1: steps")
    assert rule.allows(1) and rule.allows(-1) and not rule.allows(0) and not rule.allows(True)
    rule = parse_rule("[0, 1) beta")
    assert rule.allows(0) and rule.allows(0.999) and not rule.allows(1) and not rule.allows("0.5")
    assert rule.expected() == "a number >= 0 and < 1"
    assert parse_rule("plain prose (with parentheses)") is None and parse_rule("") is None
    for bad in ("[H, W] of the image", "(1, 0]", "{a, , b}", "[0, x)"):
        with pytest.raises(RuleError):
            parse_rule(bad)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_default_obeys_its_rule(model_type):
    leaves = schema.leaves(model_type)
    ruled = {k: leaf for k, leaf in leaves.items() if leaf.rule is not None}
    assert len(ruled) > 80
    for key, leaf in ruled.items():
        if not (isinstance(leaf.default, str) and "${" in leaf.default):
            assert leaf.rule.allows(leaf.default), (key, leaf.default, leaf.rule.expected())


def _outside(rule: Rule, default):
    """A value of the default's type that the rule refuses."""
    if rule.choices is not None:
        return "no_such_choice" if isinstance(rule.choices[0], str) else max(rule.choices) + 1
    if rule.low > -math.inf:
        value = rule.low - 1 if rule.low_closed else rule.low
    else:
        value = rule.high + 1 if rule.high_closed else rule.high
    while value in rule.also:
        value -= 1
    return int(value) if isinstance(default, int) and not isinstance(default, bool) else float(value)


@pytest.mark.parametrize("config,model_type", [("maniskill_ppo_mlp", "mlp"), ("maniskill_ppo_cnn", "cnn"),
                                                ("maniskill_ppo_openvla_oft", "openvla_oft"),
                                                ("math_grpo_tiny", "causal_lm")])
@pytest.mark.slow
def test_a_value_outside_a_rule_stops_validation_naming_the_key(config, model_type):
    cfg = compose(config)
    checked = 0
    for key, leaf in schema.leaves(model_type).items():
        if leaf.rule is None or OmegaConf.select(cfg, key, default="<absent>") == "<absent>":
            continue
        bad = OmegaConf.create(OmegaConf.to_container(cfg))
        OmegaConf.update(bad, key, _outside(leaf.rule, OmegaConf.select(cfg, key)))
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} = .*: expected {re.escape(leaf.rule.expected())}$"):
            schema.check_rules(bad)
        checked += 1
    assert checked > 60


def test_the_cli_exits_2_on_a_value_outside_its_rule(capsys):
    from embodied import cli

    assert cli._main(["--config-name", "maniskill_ppo_mlp", "algorithm.gamma=1.5"], "embodied-train") == 2
    assert "algorithm.gamma = 1.5: expected a number >= 0 and <= 1" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("actor.model.do_sample=maybe", "actor.model.do_sample = 'maybe': expected true or false"),  # default ${...}
    ("env.train.num_processes=many", "env.train.num_processes = 'many': expected a number >= 1 or null"),
    ("env.eval.video_cfg.fps=0", "env.eval.video_cfg.fps = 0: expected a number >= 1"),
    ("env.train.seed=-1", "env.train.seed = -1: expected a number >= 0"),
    ("env.eval.task_suite_name=libero_99", "env.eval.task_suite_name: not supported here, because env.eval.env_type "
                                           "maniskill does not read it"),
])
def test_a_value_no_env_or_model_allows_is_refused_where_nothing_reads_it(override, message, capsys):
    """Keys are checked against their rule before anything starts; a key of another env (a suite
    for ManiSkill) is refused first."""
    from embodied import cli

    assert cli._main(["--config-name", "maniskill_ppo_mlp", "--dry-run", override], "embodied-train") == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------ choices are implemented
def test_every_declared_choice_is_implemented():
    from embodied.algorithms.kl import kl_penalty
    from embodied.algorithms.levels import chunks_to_steps
    from embodied.algorithms.losses import aggregate_loss
    from embodied.lr_schedule import learning_rate
    from embodied.training_options import build_optimizer
    from envs.libero import SUITES
    from policies.action_heads import build_action_head
    from embodied.algorithms.levels import reduce_logprobs
    from policies.weights import DTYPES

    assert schema.choices("env.train.task_suite_name") == SUITES
    lp, ref = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    for name in schema.choices("algorithm.kl_penalty_type"):
        assert kl_penalty(lp, ref, name).shape == lp.shape
    assert schema.choices("algorithm.kl_penalty") == schema.choices("algorithm.kl_penalty_type")
    for name in schema.choices("algorithm.loss_agg_func"):
        assert aggregate_loss(lp.abs(), None, name) > 0
    for name in schema.choices("algorithm.logprob_type"):
        reduce_logprobs(lp, name)
    for name in schema.choices("algorithm.reward_type"):
        chunks_to_steps(lp, name)
    base = OmegaConf.load(CONFIG_DIR / "base.yaml").actor
    for style in schema.choices("actor.lr_sched.lr_decay_style"):
        sched = dict(base.lr_sched, max_lr=1.0, min_lr=0.1, lr_decay_style=style)
        assert 0.1 <= learning_rate(5, sched, total_steps=10) <= 1.0
    for name in schema.choices("actor.optim.optimizer"):
        optim = OmegaConf.merge(base.optim, {"optimizer": name})
        build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))]}], optim)
    for key in ("actor.fsdp_config.mixed_precision.param_dtype", "actor.model.precision"):
        assert set(schema.choices(key)) <= set(DTYPES)
    for kind in schema.choices("actor.model.action_distribution"):
        build_action_head({"action_distribution": kind, "init_log_std": -0.5, "n_action_bins": 8}, 4, 2, 3)
    with pytest.raises(ValueError, match=r"algorithm.kl_penalty_type = 'k9': expected one of \['kl', "):
        kl_penalty(lp, ref, "k9")
    with pytest.raises(ValueError, match="actor.lr_sched.lr_decay_style = 'step'"):
        learning_rate(5, dict(base.lr_sched, max_lr=1.0, min_lr=0.0, lr_decay_style="step"), total_steps=10)


# ------------------------------------------------------- every key is read or refused
def _declared() -> dict[str, Path]:
    """``CONFIG_KEYS`` of every module and the ``reads`` of the losses and estimators: key ->
    module that reads it."""
    from embodied.algorithms import ADVANTAGES, POLICY_LOSSES, advantages, imitation, losses

    out = {key: Path(advantages.__file__) for name in ADVANTAGES.names() for key in ADVANTAGES.reads(name)}
    for name in POLICY_LOSSES.names():
        module = imitation if POLICY_LOSSES.declared(name)["imitation"] else losses
        out |= dict.fromkeys(POLICY_LOSSES.reads(name), Path(module.__file__))
    for path in CODE:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CONFIG_KEYS" for t in node.targets):
                for key in ast.literal_eval(node.value):
                    out[key] = path
    return out


INTERPOLATION = re.compile(r"\$\{(?:[a-z_]+:)?([a-z_][\w.]*)")


def _referenced(config_dir: Path, read: set[str]) -> set[str]:
    """Keys that config files pass on by interpolation (``${key}``) to a place that is read:
    experiment and group files, and schema leaves that are read (or passed on themselves)."""
    refs = set()
    for path in config_dir.rglob("*.yaml"):
        if path.name != "base.yaml" or path.parent.name not in (config_dir.name, "model", "env"):
            refs |= set(INTERPOLATION.findall(path.read_text()))
    leaves = schema.leaves(None, config_dir)
    counted, new = set(), read | refs
    while new:  # a chain such as runner.seq_length -> sampling_params.max_new_tokens -> action_dim
        counted |= new
        found = {r for k in new if isinstance(getattr(leaves.get(k), "default", None), str)
                 for r in INTERPOLATION.findall(leaves[k].default)}
        new = found - counted
    return counted


def _generic(key: str) -> str:
    parts = key.split(".")
    return ".".join(["env", "*", *parts[2:]]) if parts[0] == "env" and parts[1] in schema.ENV_SPLITS else key


def unaccounted(config_dir: Path = CONFIG_DIR) -> list[str]:
    """Schema keys that no code declares reading and that are not refused (keys only the
    Megatron backend reads count as refused: the fsdp backend refuses them)."""
    declared = {_generic(k) for k in _declared()}
    models: dict[str, set[str]] = {}
    for name in MODEL_TYPES:
        classes = [POLICIES.get(name), *(load(t) for t in POLICIES.declared(name)["training"].values())]
        own = {k for cls in classes for c in cls.__mro__ for k in vars(c).get("config_keys", ())}
        models[name] = {f"actor.model.{k}" for k in own | {k for cls in classes for k in cls.refused_keys}}
    megatron_only = set(BACKENDS.reads("megatron"))
    leaves = {}
    for name in MODEL_TYPES:
        leaves |= {(k, name if k.startswith("actor.model.") else None): leaf
                   for k, leaf in schema.leaves(name, config_dir).items()}
    read = {key for key, model in leaves if _generic(key) in declared
            or (model is not None and key in models[model])}
    refs = _referenced(config_dir, read)
    missing = []
    for key, model in leaves:
        if key in read or refused.refusal(key) or key in megatron_only or key in refs \
                or _generic(key) in {_generic(r) for r in refs}:
            continue
        missing.append(f"{key} ({model})" if model else key)
    return sorted(set(missing))


def test_every_schema_key_is_read_or_refused():
    assert unaccounted() == []


def test_a_new_key_that_nothing_reads_fails_the_invariant(tmp_path):
    config = tmp_path / "config"
    shutil.copytree(CONFIG_DIR, config)
    base = config / "base.yaml"
    base.write_text(base.read_text().replace("  gamma: 0.99", "  shiny_new_option: 3\n  gamma: 0.99", 1))
    model = config / "model" / "mlp.yaml"
    model.write_text(model.read_text() + "lonely_width: 4\n")
    assert unaccounted(config) == ["actor.model.lonely_width (mlp)", "algorithm.shiny_new_option"]


def test_declarations_name_schema_keys_that_their_module_reads():
    every = {_generic(k) for name in MODEL_TYPES for k in schema.leaves(name)}
    for key, path in _declared().items():
        assert _generic(key) in every, f"{path.name} declares {key}, which the schema does not have"
        source = re.sub(r"CONFIG_KEYS = \([^)]*\)", "", path.read_text())
        last = key.rsplit(".", 1)[-1]
        assert re.search(rf"""(\.{last}\b|["']{last}["'])""", source), f"{path.name} declares {key} but never reads it"
    package = re.sub(r"config_keys = \([^)]*\)", "", "\n".join(p.read_text() for p in (ROOT / "policies").rglob("*.py")))
    for name in MODEL_TYPES:
        cls = POLICIES.get(name)
        schema_keys = {k.removeprefix("actor.model.") for k in schema.leaves(name) if k.startswith("actor.model.")}
        for key in vars(cls).get("config_keys", ()):
            assert key in schema_keys, f"{cls.__name__} reads actor.model.{key}, which model/{name}.yaml lacks"
            assert re.search(rf"""(\.{key}\b|["']{key}["'])""", package), f"{cls.__name__} never reads {key}"


# ------------------------------------------------- keys read only by some models / envs
REFUSALS = [
    ("maniskill_ppo_mlp", ["actor.model.action_distribution=bins", "actor.model.init_log_std=-1.0"],
     "actor.model.init_log_std: not supported here, because the bins head has no Gaussian std"),
    ("maniskill_ppo_mlp", ["actor.model.n_action_bins=16"],
     "actor.model.n_action_bins: not supported here, because the gaussian head has no bins"),
    ("maniskill_ppo_mlp", ["algorithm.sampling_params.top_k=5"],
     "algorithm.sampling_params.top_k: not supported here, because actor.model.model_type mlp does not read it "
     "(causal_lm or openvla_oft do: top-k filtering of sampled tokens)"),
    ("maniskill_ppo_mlp", ["data.seed=3"], "data.seed: not supported here, because only text or agent envs"),
    ("maniskill_ppo_mlp", ["algorithm.sampling_params.temperature_eval=0.5"],
     "algorithm.sampling_params.temperature_eval: not supported here, because actor.model.model_type mlp does not "
     "read it (causal_lm or openvla_oft do"),
    ("maniskill_grpo_mlp", ["algorithm.huber_delta=1.0"],
     "algorithm.huber_delta: not supported here, because algorithm.adv_type grpo does not read it (gae does: "),
    ("maniskill_grpo_mlp", ["algorithm.gae_lambda=0.9"],
     "algorithm.gae_lambda: not supported here, because algorithm.adv_type grpo does not read it (gae does"),
    ("maniskill_grpo_mlp", ["algorithm.gamma=1.0"],
     "algorithm.gamma: not supported here, because algorithm.adv_type grpo does not read it (gae does"),
    ("maniskill_ppo_mlp", ["algorithm.norm_adv_by_std_in_grpo=false"],
     "algorithm.norm_adv_by_std_in_grpo: not supported here, because algorithm.adv_type gae does not read it (grpo"),
    ("maniskill_ppo_mlp", ["algorithm.filter_rewards=true"],
     "algorithm.filter_rewards: not supported here, because algorithm.adv_type gae does not read it (grpo does"),
    ("maniskill_sft_mlp", ["algorithm.kl_penalty_type=mse"],
     "algorithm.kl_penalty_type: not supported here, because algorithm.loss_type sft does not read it (ppo or "),
    ("maniskill_ppo_mlp", ["env.eval.task_suite_name=libero_10"],
     "env.eval.task_suite_name: not supported here, because env.eval.env_type maniskill does not read it (libero"),
    ("maniskill_sft_mlp", ["algorithm.gae_lambda=0.9"],
     "algorithm.gae_lambda: not supported here, because algorithm.loss_type sft computes no advantages"),
    ("maniskill_ppo_mlp", ["actor.model.is_lora=true"], "actor.model.is_lora: not supported: LoRA adapters"),
    ("maniskill_ppo_openvla_oft", ["actor.model.action_head=l1_regression", "algorithm.sampling_params.temperature=0.5"],
     "algorithm.sampling_params.temperature: not supported here, because the l1_regression head samples no token "
     "logits (the discrete head does)"),
    ("maniskill_ppo_openvla_oft", ["actor.tokenizer.use_fast=false"],
     "actor.tokenizer.use_fast: not supported here, because actor.model.model_type openvla_oft does not read it "
     "(causal_lm does: its own tokenizer; the others read the one saved in their checkpoint)"),
    ("maniskill_ppo_mlp", ["runner.max_prompt_length=64"],
     "runner.max_prompt_length: not supported here, because actor.model.model_type mlp does not read it "
     "(openvla_oft does: the tokens of a task description)"),
    ("maniskill_ppo_openvla_oft", ["actor.model.trust_remote_code=true"],
     "actor.model.trust_remote_code: not supported: remote code"),
    ("math_grpo_tiny", ["actor.model.value_head_hidden_sizes=[16]"],
     "actor.model.value_head_hidden_sizes: not supported here, because a value head's widths need "
     "actor.model.add_value_head true"),
    ("maniskill_grpo_openvla_oft", ["actor.model.value_head_hidden_sizes=[16]"],
     "actor.model.value_head_hidden_sizes: not supported here, because a value head's widths need"),
    ("maniskill_ppo_openvla_oft", ["actor.model.is_lora=false", "actor.model.lora_path=/tmp"],
     "actor.model.lora_path: not supported here, because a LoRA adapter needs actor.model.is_lora true"),
    ("math_grpo_tiny", ["actor.model.add_value_head=true", "rollout.backend=vllm"],
     "actor.model.add_value_head: not supported here, because rollout.backend vllm computes no values"),
    ("math_grpo_tiny", ["actor.model.add_value_head=true", "actor.training_backend=megatron"],
     "actor.model.add_value_head: not supported here, because actor.training_backend megatron trains no value head"),
    ("math_grpo_tiny", ["rollout.gpu_memory_utilization=0.9"],
     "rollout.gpu_memory_utilization: not supported here, because rollout.backend is huggingface"),
    ("maniskill_ppo_mlp", ["algorithm.n_minibatches=2"], "algorithm.n_minibatches: not supported: setting the updates per batch"),
]


@pytest.mark.parametrize("config,overrides,message", REFUSALS)
def test_a_key_set_where_nothing_reads_it_is_refused(config, overrides, message):
    with pytest.raises(ConfigError) as err:
        refused.refuse_unsupported(compose(config, overrides))
    assert str(err.value).startswith(message)


def test_keys_that_this_config_reads_are_not_refused():
    refused.refuse_unsupported(compose("maniskill_ppo_openvla_oft", ["algorithm.sampling_params.temperature=0.5"]))
    refused.refuse_unsupported(compose("maniskill_ppo_mlp", ["actor.model.action_distribution=bins",
                                                             "actor.model.n_action_bins=16", "algorithm.huber_delta=1.0",
                                                             "algorithm.gae_lambda=0.9"]))
    refused.refuse_unsupported(compose("maniskill_grpo_mlp", ["algorithm.filter_rewards=true",
                                                              "algorithm.norm_adv_by_std_in_grpo=false"]))
    refused.refuse_unsupported(compose("maniskill_sft_mlp", ["data.demo_paths=[a.h5]"]))
    refused.refuse_unsupported(compose("math_grpo_tiny", ["algorithm.sampling_params.top_p=0.9", "data.seed=3"]))


def test_a_key_of_another_model_names_the_models_that_read_it():
    with pytest.raises(ConfigError, match=r"^actor.model.lora_rank: not supported by model_type mlp, because "
                                          r"only causal_lm, openvla_oft read it$"):
        compose("maniskill_ppo_mlp", ["+actor.model.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"^actor.model.model_path: not supported by this config's model_type, "
                                          r"because only causal_lm, openvla_oft read it$"):
        compose("maniskill_ppo_mlp", ["actor.model.model_path=/tmp"])


@pytest.mark.parametrize("config", ["math_grpo_tiny", "maniskill_ppo_openvla_oft"])
def test_a_model_type_reads_the_keys_it_declares(config):
    """Each key outside the model's options that a model type declares (``reads`` in
    policies/__init__.py) changes, when set, what its policy classes (the actor's, the rollout
    worker's) are built from, or is one the rollout worker reads for it (the eval temperature);
    leaves refused under every model type (``actor.tokenizer.padding_side: right``) aside."""
    from embodied.workers.rollout import CONFIG_KEYS as ROLLOUT_READS

    cfg = compose(config)
    kind = cfg.actor.model.model_type
    own = {k for c in POLICIES.get(kind).__mro__ for k in vars(c).get("config_keys", ())}

    def built_from(cfg):  # the actor's policy and the rollout worker's
        model, rollout = OmegaConf.to_container(cfg.actor.model, resolve=True), rollout_options(cfg)
        return [{k: options.get(k) for k in own} for options in (model, rollout)]

    before = built_from(cfg)
    for declared in POLICIES.reads(kind):
        leaves = [k for k in schema.leaves(kind) if k == declared or k.startswith(declared + ".")]
        assert leaves, f"{kind} declares {declared}, which the schema lacks"
        for key in leaves:
            if key in ROLLOUT_READS or refused.refusal(key):  # refused under every model (tokenizer_type)
                continue
            value = OmegaConf.select(cfg, key)
            changed = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v / 2 + 0.125,
                       str: lambda v: v + "x", type(None): lambda v: 7}[type(value)](value)
            assert built_from(compose(config, [f"{key}={changed}"])) != before, \
                f"{kind} declares {key}, but setting it changes none of its options"


def test_task_type_picks_the_checks():
    with pytest.raises(ConfigError, match=r"^env.train.env_type = 'maniskill': expected text with runner.task_type=math"):
        validate.validate(compose("maniskill_ppo_mlp", ["runner.task_type=math"]))


class Reads(dict):
    """Options that note each key read from them."""

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def _rollout(steps: int = 6, envs: int = 4, chunks: int = 2, dims: int = 3):
    from embodied.batch import Trajectory

    g = torch.Generator().manual_seed(0)
    done = torch.rand(steps, envs, chunks, generator=g) < 0.1
    return Trajectory(
        forward_inputs={"states": torch.randn(steps, envs, 5, generator=g)},
        actions=torch.randn(steps, envs, chunks, dims, generator=g),
        logprobs=-torch.rand(steps, envs, chunks, dims, generator=g),
        token_mask=torch.ones(steps, envs, chunks, dims, dtype=torch.bool),
        rewards=torch.rand(steps, envs, chunks, generator=g), terminations=done, truncations=torch.zeros_like(done),
        values=torch.randn(steps + 1, envs, generator=g))


@pytest.mark.parametrize("adv", ["gae", "grpo"])
def test_an_estimator_reads_what_it_declares_and_nothing_it_does_not(adv):
    """Run the estimator's path (its advantages, the batch whitening, the loss's options): every
    key it declares is read (but the critic's warm-up, which the actor reads per step), and the
    estimator itself reads no algorithm key that it does not declare but the group size."""
    from embodied.algorithms import ADVANTAGES, loss_hyperparameters
    from embodied.algorithms.advantages import StepSignals
    from embodied.algorithms.trajectory import normalize, training_samples

    base = OmegaConf.to_container(compose("maniskill_ppo_mlp").algorithm, resolve=True)
    algo = Reads(base | {"adv_type": adv, "group_size": 2})
    normalize(training_samples(_rollout(), algo), algo, None)
    loss_hyperparameters(algo)
    declared = {key.removeprefix("algorithm.") for key in ADVANTAGES.reads(adv)}
    assert declared - {"critic_warmup"} <= algo.read

    alone = Reads(dict(algo))
    traj = _rollout()
    ADVANTAGES.get(adv)(StepSignals(traj.rewards.sum(-1), traj.terminations.any(-1), traj.truncations.any(-1),
                                    traj.values), alone)
    assert alone.read <= declared | {"group_size"}


@pytest.mark.parametrize("loss", ["ppo", "decoupled_actor_critic"])
def test_a_policy_loss_reads_what_it_declares(loss):
    """The loss's own options, read by running it: those it declares are read, and it reads
    none that it does not declare (the actor reads the update's other keys, CONFIG_KEYS)."""
    from embodied.algorithms import POLICY_LOSSES, actor_critic_loss, loss_hyperparameters
    from embodied.algorithms.advantages import CRITIC_TRAINING

    base = OmegaConf.to_container(compose("maniskill_ppo_mlp").algorithm, resolve=True)
    algo = Reads(base | {"loss_type": loss, "behave_weight_threshold": 2.0, "early_stop_imp_ratio": 5.0})
    options = loss_hyperparameters(algo)
    g = torch.Generator().manual_seed(1)
    n = 8
    logprobs = -torch.rand(n, 2, generator=g)
    actor_critic_loss(logprobs=logprobs, old_logprobs=logprobs.detach() - 0.1, advantages=torch.randn(n, generator=g),
                      mask=torch.ones(n, dtype=torch.bool), entropy=torch.rand(n, 2, generator=g),
                      values=torch.randn(n, generator=g), old_values=torch.randn(n, generator=g),
                      returns=torch.randn(n, generator=g), ref_logprobs=logprobs.detach(),
                      policy_loss=POLICY_LOSSES.get(loss),
                      proximal_logprobs=logprobs.detach() if POLICY_LOSSES.declared(loss)["proximal"] else None,
                      **options)
    declared = {key.removeprefix("algorithm.") for key in POLICY_LOSSES.reads(loss) | CRITIC_TRAINING} | {"loss_type"}
    assert algo.read <= declared
    assert {"ratio_clip_eps", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_func",
            "entropy_bonus", "kl_beta", "kl_penalty_type", "early_stop_imp_ratio"} <= algo.read
    assert ("behave_weight_threshold" in algo.read) == POLICY_LOSSES.declared(loss)["proximal"]


def test_registered_algorithms_are_the_declared_choices():
    """Adding an estimator or a loss is its registration plus its name in config/base.yaml."""
    from embodied.algorithms import ADVANTAGES, POLICY_LOSSES

    assert list(schema.choices("algorithm.adv_type")) == ADVANTAGES.names()
    assert list(schema.choices("algorithm.loss_type")) == POLICY_LOSSES.names()
