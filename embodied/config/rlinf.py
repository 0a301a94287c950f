"""RLinf's configs, read as RLinf publishes them and carried over to this framework's schema.

Users coming from RLinf point ``--config-path`` at their RLinf config folder. Such a config is
recognized by its markers (``is_rlinf_config``), composed from its own folder as RLinf does
(its ``hydra/job_logging`` override and its ``$EMBODIED_PATH`` search path need no RLinf
package), resolved in RLinf's key space, and translated (``translate``):

- a key of this schema is read as it is (same name, same meaning);
- a key in ``RLINF_KEYS`` is renamed or converted (``Rename``, ``Convert``), or has no key here
  and is accepted only where its value says what this framework does anyway (``Implied``);
- every other key, and every value that cannot be carried over, is collected with its reason,
  and all of them are reported in one ``ConfigError``, never one at a time.

The result is a native experiment file (``Translation.native_yaml``: our defaults list and the
translated values), composed and checked like any config of ours. docs/rlinf.md lists the table.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import ConfigError
from embodied import config
from embodied.config import schema
from embodied.config.refused import refusal

# RLinf's model and env names -> ours (their LLM families all load as Hugging Face causal LMs)
MODEL_TYPES = {"mlp_policy": "mlp", "openvla_oft": "openvla_oft", "qwen2.5": "causal_lm", "qwen3": "causal_lm",
               "qwen3_moe": "causal_lm"}
ENV_TYPES = ("maniskill", "libero")
# RLinf's other spellings of a precision (rlinf/config.py torch_dtype_from_precision) -> ours
PRECISIONS = {"bf16-mixed": "bf16", 16: "fp16", "16": "fp16", "16-mixed": "fp16", 32: "fp32", "32": "fp32",
              "32-true": "fp32"}
SPLITS = ("train", "eval")
KL_SPELLINGS = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}  # RLinf's names of the KL estimators
LIBERO_INIT_STATES = 50  # init states of each task of LIBERO's suites
NATIVE_NAME = "native"  # the translated experiment's file name in its temporary folder


class Untranslatable(Exception):
    """A value of theirs that cannot be carried over; the message says why (and how to fix it)."""


@dataclass(frozen=True)
class Unresolved:
    """A value of theirs whose interpolation fails (e.g. an unset environment variable)."""

    error: str


@dataclass(frozen=True)
class Their:
    """Their resolved leaf keys, seen from the key being translated (rules that depend on
    other keys read them here)."""

    leaves: Mapping[str, Any]
    key: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.leaves.get(key, default)

    def sibling(self, name: str, default: Any = None) -> Any:
        """The key ``name`` beside this one (``env.train.x`` -> ``env.train.<name>``)."""
        return self.get(f"{self.key.rsplit('.', 1)[0]}.{name}", default)

    @property
    def split(self) -> str:
        """The env split (``train`` / ``eval``) of an ``env.<split>.*`` key."""
        return self.key.split(".")[1]

    @property
    def unused(self) -> bool:
        """A key of the training envs of an eval-only run (they do not run)."""
        return self.key.startswith("env.train.") and bool(self.get("runner.only_eval"))

    @property
    def reasoning(self) -> bool:
        return self.get("runner.task_type") == "reasoning"

    @property
    def model_type(self) -> Any:
        """RLinf's Megatron math configs name the model under rollout.model only."""
        return self.get("actor.model.model_type", self.get("rollout.model.model_type"))

    @property
    def fsdp(self) -> bool:
        return self.get("actor.training_backend", "fsdp") == "fsdp"

    def env_type(self, split: str | None = None) -> Any:
        split = split or self.split
        return self.get(f"env.{split}.env_type", self.get(f"env.{split}.simulator_type"))


# ------------------------------------------------------------------ the table: rules of keys
@dataclass(frozen=True)
class Rename:
    """Their key (or their subtree) is ours under another name; ``*`` in ``to`` stands for the
    env split of their key. ``values`` maps their spellings of a value to ours."""

    to: str
    values: Mapping[Hashable, Any] = field(default_factory=dict)

    def apply(self, value: Any, their: Their, rest: str) -> dict[str, Any]:
        target = self.to.replace("*", their.split) if "*" in self.to else self.to
        if isinstance(value, Hashable) and value in self.values:
            value = self.values[value]
        return {f"{target}.{rest}" if rest else target: value}


@dataclass(frozen=True)
class Convert:
    """A value that needs the rest of their config to carry over: ``fn(value, their, rest)``
    returns our keys and values (none when RLinf would ignore the key) or raises
    ``Untranslatable``. ``to`` and ``how`` say it for the docs."""

    to: str
    how: str
    fn: Callable[[Any, Their, str], dict[str, Any]]

    def apply(self, value: Any, their: Their, rest: str) -> dict[str, Any]:
        return self.fn(value, their, rest)


@dataclass(frozen=True)
class Implied:
    """A key (or subtree) with no key here: accepted when ``accepts(value, their)`` holds, i.e.
    the value says what this framework does anyway; otherwise reported with ``why``."""

    accepts: Callable[[Any, Their], bool]
    why: str

    def apply(self, value: Any, their: Their, rest: str) -> dict[str, Any]:
        if not their.unused and not self.accepts(value, their):
            raise Untranslatable(self.why)
        return {}


Rule = Rename | Convert | Implied


def _equals(expected: Any) -> Callable[[Any, Their], bool]:
    return lambda value, their: value == expected


def _always(value: Any, their: Their) -> bool:
    return True


def _unless_reasoning(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf's reasoning runner overwrites the actor's batch sizes (from
    ``algorithm.training_batch_size_per_gpu`` and ``n_minibatches``)."""
    return {} if their.reasoning else {their.key: value}


def _global_batch(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf's reasoning runner: the samples of a step split into ``n_minibatches`` updates."""
    if not their.reasoning:
        return {their.key: value}
    return {"actor.global_batch_size": their.get("data.rollout_batch_size") * their.get("algorithm.group_size") // value}


def _fsdp1_only(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """FSDP1's performance options: the translation trains RLinf's FSDP1 actor with FSDP2."""
    return {} if their.get("actor.fsdp_config.strategy") == "fsdp" else {their.key: value}


def _unused_split(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """An eval-only config leaves the training envs unset (``null``): they do not run."""
    return {} if value is None and their.unused else {their.key: value}


def _megatron_only(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """Megatron's options: RLinf's FSDP actor never reads them, the Megatron backend does."""
    if their.fsdp:
        return {}
    if their.key not in schema.leaves():
        raise Untranslatable("no counterpart in the Megatron backend here")
    return {their.key: value}


def _model_type(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if value not in MODEL_TYPES:
        raise Untranslatable(f"no counterpart of RLinf's {value!r} model here (RLinf models carried "
                             f"over: {sorted(MODEL_TYPES)})")
    return {their.key: MODEL_TYPES[value]}


def _env_type(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if value not in ENV_TYPES:
        raise Untranslatable(f"no {value!r} env here (env types carried over: {list(ENV_TYPES)})")
    return {f"env.{their.split}.env_type": value}


def _task_type(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if value == "embodied_eval":
        return {"runner.task_type": "embodied", "runner.only_eval": True}
    return {"runner.task_type": {"reasoning": "math"}.get(value, value)}


def _implement_version(value: Any, their: Their, rest: str) -> dict[str, Any]:
    heads = {"rlinf": ("discrete", False), "official": ("l1_regression", True)}
    if their.model_type != "openvla_oft":
        return {}
    if value not in heads:
        raise Untranslatable(f"expected one of {list(heads)}")
    head, stop_token = heads[value]
    return {"actor.model.action_head": head, "actor.model.action_stop_token": stop_token}


def _maniskill_task(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf registers ManiSkill tasks of its own (``rlinf/envs/maniskill``: PutOnPlateInScene25Main-v3,
    PutCarrotOnPlateInScene-v2, ..., what its OpenVLA(-OFT) ManiSkill files train on), which
    ManiSkill does not have: that is the cause to name, before the options only those tasks take
    (``obj_set``, ...)."""
    if their.env_type() == "maniskill" and importlib.util.find_spec("mani_skill") is not None:
        from envs.maniskill_scene import unknown_task

        if (close := unknown_task(value)) is not None:
            raise Untranslatable("not a task of ManiSkill's: RLinf registers it itself (rlinf/envs/maniskill); "
                                 "ManiSkill's own tasks run here" + (f" (closest: {close})" if close else ""))
    return {their.key: value}


def _maniskill_control_mode(robot: str) -> str:
    """RLinf sets ManiSkill's control mode from the model's ``policy_setup`` (rlinf/config.py)."""
    modes = {"panda-qpos": "pd_joint_delta_pos", "panda-ee-dpos": "pd_ee_delta_pos",
             "panda-ee-target-dpos": "pd_ee_target_delta_pose"}
    if robot in modes:
        return modes[robot]
    if "widowx" in robot:
        return "arm_pd_ee_target_delta_pose_align2_gripper_pd_joint_pos"
    if "panda" in robot:
        return "pd_ee_body_target_delta_pose_real_root_frame"
    raise Untranslatable(f"RLinf knows no ManiSkill control mode for robot setup {robot!r}")


def _policy_setup(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf reads ``policy_setup`` for ManiSkill only: it picks the control mode, and a WidowX
    setup binarizes the gripper (``2 * (g > 0.5) - 1``, our ``normalize_gripper``)."""
    splits = [s for s in SPLITS if their.env_type(s) == "maniskill"]
    if not splits or value is None:
        return {}
    out: dict[str, Any] = {f"env.{s}.init_params.control_mode": _maniskill_control_mode(value) for s in splits}
    if "panda" not in value:
        out["actor.model.normalize_gripper"] = True
    return out


def _control_mode(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if their.env_type() == "maniskill" and their.get("actor.model.policy_setup") is not None:
        return {}  # RLinf replaces it by the one of actor.model.policy_setup
    return {their.key: value}


def _precision(value: Any, their: Their, rest: str) -> dict[str, Any]:
    value = PRECISIONS.get(value, value)
    if their.model_type != "mlp_policy":
        return {their.key: value}
    if value != "fp32":
        raise Untranslatable("the MLP here computes in fp32")
    return {}


def _specific_reset_id(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf numbers a suite's reset states task by task; every task of LIBERO's suites has 50."""
    if value is None:
        return {}
    task, state = divmod(int(value), LIBERO_INIT_STATES)
    return {f"env.{their.split}.init_params.task_ids": [task],
            f"env.{their.split}.init_params.init_state_range": [state, state + 1]}


def _reset_state_order(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if their.sibling("is_eval") or their.env_type() != "libero":  # RLinf's ManiSkill env ignores it
        return {}
    return {f"env.{their.split}.reset_state_order": "ordered" if value else "random"}


def _mlp_from_scratch(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if their.model_type != "mlp_policy":
        return {their.key: value}
    if value not in (None, ""):
        raise Untranslatable("the MLP here starts from scratch; its weights come from a checkpoint of a run "
                             "(runner.resume_dir, or runner.ckpt_path to evaluate)")
    return {}


def _same_as_actor(name: str, spellings: Mapping[Hashable, Any] = {}) -> Callable[[Any, Their, str], dict[str, Any]]:
    """``rollout.model.<name>``: null here means "the actor's", which is what RLinf's embodied
    and math configs set it to; ``spellings`` maps RLinf's other spellings of a value to ours."""
    def convert(value: Any, their: Their, rest: str) -> dict[str, Any]:
        value = spellings.get(value, value)
        actor = their.get(f"actor.model.{name}", value)
        return {} if value == spellings.get(actor, actor) else {their.key: value}
    return convert


def _buffer_dtype(value: Any, their: Their, rest: str) -> dict[str, Any]:
    if value is None or value == their.get("actor.model.precision"):
        return {}  # FSDP2 keeps buffers in the model's own dtype (our fp32 default means that)
    return {their.key: value}


def _checkpoint_tokenizer(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """OpenVLA-OFT reads the tokenizer saved in its checkpoint: RLinf's OFT configs point
    ``actor.tokenizer`` at that same folder."""
    if their.model_type == "openvla_oft":
        folder = their.get("actor.tokenizer.tokenizer_model")
        if folder is None or str(folder).rstrip("/") == str(their.get("actor.model.model_path")).rstrip("/"):
            return {}
    if their.key == "actor.tokenizer.padding_side":
        return {their.key: "left"}  # prompts are left-padded for generation; masks make the side moot
    return {their.key: value}


def _trust_remote_code(value: Any, their: Their, rest: str) -> dict[str, Any]:
    return {} if their.model_type == "openvla_oft" else {their.key: value}


def _is_eval(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf's eval protocol starts every reset state once (our ``each_reset_state_once``),
    which here runs without auto-reset: with ``ignore_terminations`` no episode ends before the
    rollout does, so RLinf's ``auto_reset`` changes nothing there."""
    if not value:
        return {}
    out: dict[str, Any] = {f"env.{their.split}.each_reset_state_once": True}
    if their.sibling("auto_reset"):
        if not their.sibling("ignore_terminations"):
            raise Untranslatable("every reset state once (each_reset_state_once) runs without auto_reset "
                                 "here; set ignore_terminations true or auto_reset false")
        out[f"env.{their.split}.auto_reset"] = False
    return out


def _grpo_groups(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf normalizes GRPO advantages over algorithm.group_size consecutive envs, whatever their
    reset states; env.*.group_size of them share one, as here."""
    group = their.get("algorithm.group_size")
    if their.get("algorithm.adv_type") == "grpo" and isinstance(group, int) and group % value:
        raise Untranslatable(f"a GRPO group here is algorithm.group_size ({group}) envs, runs of "
                             f"env.train.group_size sharing a reset state: a divisor of it")
    return {their.key: value}


def _placement(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """Component names: RLinf's math reward worker is our text env worker (it scores answers);
    a math config that places no reward worker scores where it generates, so the env worker
    goes with the rollout."""
    names = []
    for name in (n.strip() for n in rest.split(",")):
        if name == "reward" and their.reasoning:
            name = "env"
        elif name not in ("actor", "env", "rollout"):
            raise Untranslatable(f"no {name!r} component here (components: actor, env, rollout; "
                                 "rewards come from the env workers)")
        names.append(name)
    lines = [k.split(".")[2] for k in their.leaves if k.startswith("cluster.component_placement.")]
    if their.reasoning and "rollout" in names and not any("reward" in line.split(",") for line in lines):
        names.append("env")
    return {f"cluster.component_placement.{','.join(names)}": value}


def _filter_bounds(value: Any, their: Their) -> bool:
    """With success rewards of 0 or ``reward_coef`` per episode, RLinf's bounds on a group's
    mean reward keep exactly the groups that neither all fail nor all succeed (our filter)
    when lower <= coef / group_size and upper >= coef * (1 - 1 / group_size)."""
    if not their.get("algorithm.filter_rewards"):
        return True
    coef = their.get("env.train.reward_coef", their.get("algorithm.reward_coef", 1.0))
    size = their.get("algorithm.group_size", 1)
    low, high = their.get("algorithm.rewards_lower_bound"), their.get("algorithm.rewards_upper_bound")
    return (low is None or 0 < low <= coef / size) and (high is None or coef * (1 - 1 / size) <= high < coef)


def _temperature_eval(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf samples evaluation episodes at a temperature above 0 and is greedy otherwise."""
    return {"algorithm.sampling_params.temperature_eval": value if value is not None and value > 0 else 0.0}


def _reset_gripper_open(value: Any, their: Their, rest: str) -> dict[str, Any]:
    return {f"env.{their.split}.init_params.reset_gripper_open": bool(value)} if their.env_type() == "libero" else {}


def _lossless_sync(value: Any, their: Their) -> bool:
    return all(v in (None, "none") for k, v in their.leaves.items()
               if k.startswith("weight_syncer.") and k.endswith("compression"))


def _no_inference_worker(value: Any, their: Their) -> bool:
    """RLinf runs its inference worker only where the placement names one."""
    lines = [k.split(".")[2] for k in their.leaves if k.startswith("cluster.component_placement.")]
    return not any("inference" in line.split(",") for line in lines)


def _eval_once(value: Any, their: Their) -> bool:
    return value in (None, 1)


def _reinpp_kl(their: Their) -> bool:
    return their.get("algorithm.adv_type") == "reinpp" and bool(their.get("algorithm.reinpp_kl_beta"))


def _kl_beta(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf's kl_beta weighs a KL term of the loss; REINFORCE++'s own KL (reinpp_kl_beta) goes
    into the rewards, and only one KL weight exists here."""
    if _reinpp_kl(their):
        if value:
            raise Untranslatable("a KL in the loss beside REINFORCE++'s KL in the rewards (reinpp_kl_beta); "
                                 "one KL weight here (algorithm.kl_beta, in the rewards or the loss)")
        return {}
    return {"algorithm.kl_beta": value, "algorithm.use_kl_in_reward": False} if value else {"algorithm.kl_beta": value}


def _reinpp_kl_beta(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """REINFORCE++'s KL, subtracted from the rewards with RLinf's kl_penalty_type as the estimator."""
    if not _reinpp_kl(their):
        return {}  # RLinf reads it only with adv_type reinpp
    kind = their.get("algorithm.kl_penalty_type", "kl")
    return {"algorithm.kl_beta": value, "algorithm.use_kl_in_reward": True,
            "algorithm.kl_penalty": KL_SPELLINGS.get(kind, kind)}


def _is_fix(their: Their) -> bool:
    return bool(their.get("algorithm.importance_sampling_fix"))


def _adv_type(value: Any, their: Their, rest: str) -> dict[str, Any]:
    """RLinf's REINFORCE++ with its baseline flag is this framework's reinpp_baseline."""
    if value == "reinpp" and their.get("algorithm.use_reinpp_baseline"):
        return {"algorithm.adv_type": "reinpp_baseline"}
    return {"algorithm.adv_type": value}


CRITIC_WARMUP = ("RLinf's warm-up counts optimizer steps (minibatches) and rebuilds the optimizer after it; "
                 "here algorithm.critic_warmup counts training steps and keeps the optimizer: set it instead")
EVAL_WINDOW = "an evaluation here runs whole episodes of max_episode_steps; set it to max_episode_steps"
FSDP_MEGATRON_KEYS = (  # Megatron's options that RLinf's FSDP actor never reads
    "actor.megatron", "actor.mcore_gpt", "actor.spec_name", "actor.offload_optimizer", "actor.offload_weight",
    "actor.offload_grad", "actor.enable_dp_load_balance", "actor.optim.bf16", "actor.optim.fp16",
    "actor.optim.loss_scale", "actor.optim.loss_scale_window", "actor.optim.use_distributed_optimizer",
    "actor.optim.overlap_grad_reduce", "actor.optim.overlap_param_gather",
    "actor.optim.overlap_param_gather_with_optimizer_step", "actor.optim.optimizer_enable_pin",
    *(f"actor.model.{key}" for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "activation", "sequence_parallel",
        "recompute_method", "recompute_granularity", "recompute_num_layers", "seq_length",
        "encoder_seq_length", "normalization", "position_embedding_type", "apply_rope_fusion",
        "bias_dropout_fusion", "persist_layer_norm", "bias_activation_fusion", "attention_softmax_in_fp32",
        "batch_p2p_comm", "variable_seq_lengths", "gradient_accumulation_fusion", "moe_token_dispatcher_type",
        "use_cpu_initialization", "megatron_checkpoint", "add_bias_linear", "add_qkv_bias")),
)

# Their key -> its rule. ``*`` matches one key segment (the env split); a rule on a node applies
# to every key under it. A key that is in this schema and not here is read as it is.
RLINF_KEYS: dict[str, Rule] = {
    # runner
    "runner.task_type": Convert("runner.task_type", "reasoning -> math; embodied_eval -> embodied with "
                                "runner.only_eval true", _task_type),
    "runner.seq_length": Convert("runner.seq_length", "embodied: dropped (RLinf's embodied runner does not "
                                 "read it)", lambda v, their, rest: {their.key: v} if their.reasoning else {}),
    "runner.max_tokens_per_mbs": Convert("runner.max_tokens_per_mbs", "dropped without "
                                         "runner.enable_dynamic_batch_size (unused then)",
                                         lambda v, their, rest: {their.key: v} if their.get(
                                             "runner.enable_dynamic_batch_size") else {}),
    "runner.eval_policy_path": Implied(_equals(None), "a .pt policy file to evaluate; embodied-eval takes "
                                       "runner.ckpt_path (a checkpoint folder of a run) here"),
    # algorithm
    "algorithm.loss_type": Rename("algorithm.loss_type", {"actor": "ppo", "actor_critic": "ppo"}),
    "algorithm.bootstrap_type": Rename("algorithm.bootstrap_at_done", {"standard": "truncated", "always": "always"}),
    "algorithm.kl_penalty": Rename("algorithm.kl_penalty", KL_SPELLINGS),
    "algorithm.kl_penalty_type": Rename("algorithm.kl_penalty_type", KL_SPELLINGS),
    "algorithm.kl_beta": Convert("algorithm.kl_beta", "in the loss (use_kl_in_reward false), as RLinf's actor "
                                 "adds it", _kl_beta),
    "algorithm.adv_type": Convert("algorithm.adv_type", "reinpp with use_reinpp_baseline -> reinpp_baseline",
                                  _adv_type),
    "algorithm.use_reinpp_baseline": Implied(_always, "read with adv_type reinpp, which it makes reinpp_baseline"),
    "algorithm.reinpp_kl_beta": Convert("algorithm.kl_beta", "with adv_type reinpp: kl_beta in the rewards "
                                        "(use_kl_in_reward), kl_penalty from kl_penalty_type", _reinpp_kl_beta),
    "algorithm.update_epoch": Rename("algorithm.update_epochs"),
    "algorithm.recompute_logprobs": Convert("rollout.recompute_logprobs", "true also with importance_sampling_fix, "
                                            "as RLinf sets it", lambda v, their, rest: {
                                                "rollout.recompute_logprobs": bool(v or _is_fix(their))}),
    "algorithm.sampling_params.temperature_train": Rename("algorithm.sampling_params.temperature"),
    "algorithm.sampling_params.temperature_eval": Convert("algorithm.sampling_params.temperature_eval",
                                                          "<= 0 or null -> 0 (greedy)", _temperature_eval),
    "algorithm.eval_rollout_epoch": Implied(_eval_once, "an evaluation runs each eval env's episodes once "
                                            "(env.eval.each_reset_state_once for every reset state)"),
    "algorithm.huber_delta": Convert("algorithm.huber_delta", "dropped without a value loss (adv_type not gae)",
                                     lambda v, their, rest: {their.key: v} if their.get("algorithm.adv_type") == "gae"
                                     else {}),
    "algorithm.critic_warmup_steps": Implied(_equals(0), CRITIC_WARMUP),
    "algorithm.reward_coef": Implied(_always, "RLinf's code reads env.*.reward_coef, which carries it"),
    "algorithm.rewards_lower_bound": Implied(_filter_bounds, "groups are filtered (filter_rewards) when "
                                             "they all succeed or all fail, not by bounds on the mean reward"),
    "algorithm.rewards_upper_bound": Implied(_filter_bounds, "groups are filtered (filter_rewards) when "
                                             "they all succeed or all fail, not by bounds on the mean reward"),
    "algorithm.max_num_gen_batches": Implied(_equals(1), "generating more batches until enough groups pass "
                                             "filter_rewards is not implemented"),
    "algorithm.importance_sampling_fix": Convert("algorithm.importance_sampling_fix", "same, with "
                                                 "rollout.recompute_logprobs true, as RLinf sets it",
                                                 lambda v, their, rest: {their.key: bool(v)} | (
                                                     {"rollout.recompute_logprobs": True} if v else {})),
    "algorithm.importance_sampling_clip": Convert("algorithm.importance_sampling_clip", "dropped without "
                                                  "importance_sampling_fix (unused then)",
                                                  lambda v, their, rest: {their.key: v} if _is_fix(their) else {}),
    "algorithm.rollout_batch_size_per_gpu": Implied(_always, "read only by RLinf's vLLM worker before RLinf #222 "
                                                    "(Nov 2025), to split a generation request into batches "
                                                    "that bound memory; the engines here batch a stage's "
                                                    "prompts themselves"),
    "algorithm.training_batch_size_per_gpu": Convert(
        "actor.micro_batch_size", "math: RLinf's micro-batch (its actor.micro_batch_size is overwritten)",
        lambda v, their, rest: {"actor.micro_batch_size": v} if their.reasoning else {their.key: v}),
    "algorithm.n_minibatches": Convert(
        "actor.global_batch_size", "math: data.rollout_batch_size x algorithm.group_size / n_minibatches, "
        "as RLinf computes it", _global_batch),
    "actor.micro_batch_size": Convert("actor.micro_batch_size", "math: ignored, RLinf overwrites it",
                                      _unless_reasoning),
    "actor.global_batch_size": Convert("actor.global_batch_size", "math: ignored, RLinf overwrites it",
                                       _unless_reasoning),
    # rollout
    "rollout.mode": Implied(_always, "the mode follows from cluster.component_placement here"),
    "rollout.sampling_params.temperature_train": Rename("algorithm.sampling_params.temperature"),
    "rollout.sampling_params.temperature_eval": Convert("algorithm.sampling_params.temperature_eval",
                                                        "<= 0 or null -> 0 (greedy)", _temperature_eval),
    "rollout.sampling_params": Rename("algorithm.sampling_params"),
    "rollout.generation_backend": Rename("rollout.backend"),
    "rollout.rollout_backend": Rename("rollout.backend"),
    "rollout.model.model_path": Convert("rollout.model.model_path", "null (= the actor's) when it is "
                                        "actor.model.model_path", _same_as_actor("model_path")),
    "rollout.model.model_type": Convert("rollout.model.model_type", "null (= the actor's) when it is "
                                        "actor.model.model_type", _same_as_actor("model_type")),
    "rollout.model.precision": Convert("rollout.model.precision", "null (= the actor's) when it is "
                                       "actor.model.precision", _same_as_actor("precision", PRECISIONS)),
    "rollout.return_logprobs": Implied(lambda v, their: v == (not their.get("algorithm.recompute_logprobs")),
                                       "the rollout always returns its log-probs here; "
                                       "rollout.recompute_logprobs says whether the actor recomputes them"),
    "rollout.sglang.attention_backend": Rename("rollout.attention_backend"),
    "rollout.sglang.decode_log_interval": Rename("rollout.sglang_decode_log_interval"),
    "rollout.sglang.use_torch_compile": Rename("rollout.use_torch_compile"),
    "rollout.sglang.torch_compile_max_bs": Rename("rollout.torch_compile_max_bs"),
    **{f"rollout.{key}": Implied(_always, "a speed option of RLinf's rollout (torch.compile, CUDA graphs): "
                                 "the rollout here runs the policy eagerly, computing the same actions")
       for key in ("enable_torch_compile", "enable_cuda_graph")},
    "rollout.vllm": Implied(_always, "vLLM's performance options (kernels, prefix caching, chunked "
                            "prefill, scheduling): they do not change what it generates"),
    # actor
    "actor.fsdp_config.amp.enabled": Rename("actor.fsdp_config.amp_autocast.enabled"),
    "actor.fsdp_config.amp.precision": Rename("actor.fsdp_config.amp_autocast.precision"),
    "actor.fsdp_config.amp.use_grad_scaler": Rename("actor.fsdp_config.grad_scaler.enabled"),
    "actor.fsdp_config.gradient_checkpointing": Rename("actor.model.gradient_checkpointing"),
    "actor.fsdp_config.sharding_strategy": Rename("actor.fsdp_config.sharding_strategy"),
    "actor.fsdp_config.strategy": Rename("actor.fsdp_config.strategy", {"fsdp": "fsdp2"}),
    **{f"actor.fsdp_config.{key}": Convert(f"actor.fsdp_config.{key}", "dropped with strategy fsdp (an FSDP1 "
                                           "tuning option; FSDP2 prefetches by itself)", _fsdp1_only)
       for key in ("forward_prefetch", "backward_prefetch", "limit_all_gathers", "use_orig_params",
                   "enable_gradient_accumulation")},
    "actor.fsdp_config.mixed_precision.param_dtype": Rename("actor.fsdp_config.mixed_precision.param_dtype",
                                                            {None: "fp32", **PRECISIONS}),
    "actor.fsdp_config.mixed_precision.reduce_dtype": Rename("actor.fsdp_config.mixed_precision.reduce_dtype",
                                                             {None: "fp32", **PRECISIONS}),
    "actor.model.precision": Convert("actor.model.precision", "mlp_policy: fp32 -> dropped (the MLP computes "
                                     "in fp32)", _precision),
    "actor.fsdp_config.mixed_precision.buffer_dtype": Convert(
        "actor.fsdp_config.mixed_precision.buffer_dtype", "null or actor.model.precision -> the default "
        "(FSDP2 keeps buffers in the model's dtype)", _buffer_dtype),
    "actor.optim.critic_warmup_steps": Implied(_equals(0), CRITIC_WARMUP),
    "actor.megatron.ckpt_convertor": Implied(
        lambda v, their: their.fsdp or their.get("actor.megatron.ckpt_convertor.hf_model_path") == their.get(
            "actor.model.model_path"),
        "RLinf's converter of Hugging Face weights to Megatron's format; the Megatron backend here loads "
        "the Hugging Face folder actor.model.model_path itself, so it converts only that one"),
    "actor.megatron.use_profiler": Implied(lambda v, their: their.fsdp or not v,
                                           "the Megatron profiler is not wired in here"),
    "actor.megatron.profiler": Implied(lambda v, their: their.fsdp or not their.get("actor.megatron.use_profiler"),
                                       "the Megatron profiler is not wired in here"),
    **{key: Convert(key, "dropped with training_backend fsdp (RLinf's FSDP actor ignores it)", _megatron_only)
       for key in FSDP_MEGATRON_KEYS},
    "actor.model.obs_dim": Rename("actor.model.state_dim"),
    "actor.model.model_path": Convert("actor.model.model_path", "mlp_policy: empty -> dropped (the MLP starts from "
                                      "scratch, as RLinf's does)", _mlp_from_scratch),
    "actor.model.lora_rank": Convert("actor.model.lora_rank", "dropped without actor.model.is_lora",
                                     lambda v, their, rest: {their.key: v} if their.get("actor.model.is_lora") else {}),
    "actor.model.hidden_dim": Implied(_always, "RLinf's mlp_policy ignores it (three tanh layers of 256); here "
                                      "actor.model.hidden_dims, by default the same three"),
    "actor.model.model_type": Convert("actor.model.model_type", f"{MODEL_TYPES}", _model_type),
    "actor.model.implement_version": Convert("actor.model.action_head, actor.model.action_stop_token",
                                             "rlinf -> discrete, false; official -> l1_regression, true",
                                             _implement_version),
    "actor.model.use_film": Implied(_equals(False), "FiLM conditioning of the vision backbone is not "
                                    "implemented in this OpenVLA-OFT"),
    "actor.model.policy_setup": Convert("env.*.init_params.control_mode, actor.model.normalize_gripper",
                                        "ManiSkill: the robot's control mode; widowx binarizes the gripper",
                                        _policy_setup),
    "actor.model.trust_remote_code": Convert("actor.model.trust_remote_code", "openvla_oft: dropped (it is "
                                             "implemented here, no checkpoint code runs)", _trust_remote_code),
    "actor.tokenizer": Convert("actor.tokenizer", "openvla_oft: dropped when it is the checkpoint's own; "
                               "padding_side -> left", _checkpoint_tokenizer),
    # env
    "env.*.simulator_type": Convert("env.*.env_type", "renamed", _env_type),
    "env.*.env_type": Convert("env.*.env_type", f"one of {list(ENV_TYPES)}", _env_type),
    "env.train.rollout_epoch": Rename("algorithm.rollout_epoch"),
    "env.*.total_num_envs": Convert("env.*.total_num_envs", "null for the training envs of an eval-only "
                                    "config -> the default (they do not run)", _unused_split),
    "env.train.group_size": Convert("env.train.group_size", "GRPO: algorithm.group_size or a divisor of it "
                                    "(the envs of an advantage group that share a reset state)", _grpo_groups),
    "env.eval.rollout_epoch": Implied(_eval_once, "an evaluation runs each eval env's episodes once "
                                      "(env.eval.each_reset_state_once for every reset state)"),
    "env.eval.max_steps_per_rollout_epoch": Implied(lambda v, their: v == their.sibling("max_episode_steps"),
                                                    EVAL_WINDOW),
    "env.train.enable_offload": Rename("env.enable_offload"),
    "env.eval.enable_offload": Implied(lambda v, their: v == their.get("env.train.enable_offload", False),
                                       "one switch here for both splits: env.enable_offload "
                                       "(from env.train.enable_offload)"),
    "env.*.is_eval": Convert("env.*.each_reset_state_once", "true -> every reset state once (auto_reset "
                             "false, a no-op with ignore_terminations)", _is_eval),
    "env.*.use_ordered_reset_state_ids": Convert("env.*.reset_state_order", "true -> ordered; false -> random "
                                                 "(drawn with replacement); LIBERO only, dropped with is_eval "
                                                 "(the eval protocol's own order), as in RLinf",
                                                 _reset_state_order),
    "env.*.reset_gripper_open": Convert("env.*.init_params.reset_gripper_open", "LIBERO: the settle steps' "
                                        "gripper command; dropped for other envs (RLinf's LIBERO env alone "
                                        "reads it)", _reset_gripper_open),
    "env.*.reward_mode": Implied(_equals("raw"), "rewards are the simulator's own here "
                                 "(ManiSkill's kind: init_params.reward_mode)"),
    "env.*.use_step_penalty": Implied(_equals(False), "no step penalty here"),
    "env.*.specific_reset_id": Convert("env.*.init_params.task_ids, env.*.init_params.init_state_range",
                                       "id k (RLinf's numbering: task k // 50, its init state k % 50) -> that "
                                       "task and that one init state", _specific_reset_id),
    "env.*.wrap_obs_mode": Implied(_equals("simple"), "observations here are main_images, wrist_images, "
                                   "states and task_descriptions (RLinf's simple wrapping)"),
    "env.*.use_full_state": Implied(_equals(False), "states here are the robot's proprioception"),
    "env.*.policy_setup": Implied(_always, "RLinf reads actor.model.policy_setup"),
    "env.*.init_params.id": Convert("env.*.init_params.id", "ManiSkill: a task of ManiSkill's registry; "
                                    "RLinf's own tasks are reported", _maniskill_task),
    "env.*.init_params.num_envs": Implied(_equals(None), "the env counts come from env.*.total_num_envs"),
    "env.*.init_params.sim_config.sim_freq": Rename("env.*.init_params.sim_freq"),
    "env.*.init_params.sim_config.control_freq": Rename("env.*.init_params.control_freq"),
    "env.*.init_params.sensor_configs.shader_pack": Rename("env.*.init_params.shader_pack"),
    "env.*.init_params.render_mode": Implied(lambda v, their: v in (None, "all", "rgb_array", "sensors"),
                                             "what is rendered follows the observations and "
                                             "env.*.video_cfg.save_video here"),
    "env.*.init_params.max_episode_steps": Implied(lambda v, their: v == their.get(
        f"env.{their.split}.max_episode_steps"), "episodes are env.*.max_episode_steps long"),
    "env.*.init_params.control_mode": Convert("env.*.init_params.control_mode", "ManiSkill: set from "
                                              "actor.model.policy_setup, as RLinf does", _control_mode),
    # the other components
    "data.filter_prompt_by_length": Implied(_equals(True), "prompts longer than data.max_prompt_length "
                                            "are always dropped (and counted) here"),
    "data.dataset_name": Implied(lambda v, their: their.reasoning, "only RLinf's VLM datasets read it"),
    "reward.group_name": Implied(_always, "a worker group's name (the env workers score answers here)"),
    "reward.tokenizer": Implied(lambda v, their: v == their.get(their.key.replace("reward.", "actor.", 1)),
                                "answers are decoded with the policy's tokenizer (actor.tokenizer)"),
    "critic": Implied(lambda v, their: not their.get("critic.use_critic_model"),
                      "a separate critic model; PPO's critic here is the policy's value head "
                      "(actor.model.add_value_head)"),
    "inference": Implied(_no_inference_worker, "RLinf's inference worker; the actor recomputes log-probs "
                         "here (rollout.recompute_logprobs)"),
    "weight_syncer": Implied(_lossless_sync, "lossy weight compression; the actor's weights reach the rollout "
                             "workers as they are here"),
    "cluster.component_placement": Convert("cluster.component_placement", "math: the reward component is "
                                           "the env (text env workers score answers)", _placement),
}

# RLinf moved these keys; where a config has both, RLinf reads the new place (rlinf/config.py)
MOVED = {"algorithm.sampling_params": "rollout.sampling_params",
         "algorithm.rollout_epoch": "env.train.rollout_epoch",
         "algorithm.eval_rollout_epoch": "env.eval.rollout_epoch"}


def rule_for(key: str) -> tuple[str, Rule, str] | None:
    """The table entry for one of their keys: (its pattern, rule, the rest of the key below the
    pattern), most specific first; None when no entry matches."""
    parts = key.split(".")
    for length in range(len(parts), 0, -1):
        head, rest = parts[:length], ".".join(parts[length:])
        exact = ".".join(head)
        if exact in RLINF_KEYS:
            return exact, RLINF_KEYS[exact], rest
        for pattern, rule in RLINF_KEYS.items():
            p = pattern.split(".")
            if len(p) == length and "*" in p and all(a in ("*", b) for a, b in zip(p, head)):
                return pattern, rule, rest
    return None


# ------------------------------------------------------------------ their side
def is_rlinf_config(config_dir: str | Path, config_name: str) -> bool:
    """Whether this experiment file is written for RLinf: its defaults list overrides Hydra's
    ``hydra/job_logging`` or its search path reads ``$EMBODIED_PATH``, and it does not start
    from our ``base`` schema."""
    path = Path(config_dir) / f"{config_name}.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(data, dict):
        return False
    defaults = data.get("defaults") or []
    if "base" in defaults:
        return False
    overrides_logging = any(isinstance(entry, dict) and "override hydra/job_logging" in entry
                            for entry in defaults)
    searchpath = (data.get("hydra") or {}).get("searchpath") or []
    return overrides_logging or any("EMBODIED_PATH" in str(entry) for entry in searchpath)


def their_leaves(config_dir: str | Path, config_name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Their config composed from its own folder as RLinf composes it, with the command-line
    overrides in their key space (a key they lack is appended, as ``+key``), resolved in their
    key space: ``{"a.b.c": value}`` for every leaf. RLinf's embodied files name the run in
    ``runner.logger.experiment_name`` only; it is ``runner.experiment_name`` too, so that
    ``${runner.experiment_name}`` (ours, as in embodied-eval's video folder) resolves."""
    directory = Path(config_dir).resolve()
    keep = _searchpath(directory / f"{config_name}.yaml")
    leaves = _leaves(_compose_theirs(directory, config_name, keep, []))
    known = {".".join(key.split(".")[:n]) for key in leaves for n in range(1, key.count(".") + 2)}
    appended = [o if _override_key(o) in known or not _override_key(o) else f"+{o}" for o in overrides]
    if "runner.experiment_name" not in leaves and "runner.logger.experiment_name" in leaves:
        appended.insert(0, "+runner.experiment_name=${runner.logger.experiment_name}")
    return _leaves(_compose_theirs(directory, config_name, keep, appended))


def _searchpath(path: Path) -> list[str]:
    """Their search path without the entries that read an unset environment variable: RLinf's
    run scripts set ``$EMBODIED_PATH`` to the folder above ``config/``, which is the folder we
    compose from anyway."""
    data = yaml.safe_load(path.read_text()) or {}
    entries = (data.get("hydra") or {}).get("searchpath") or []
    needs = [re.findall(r"\$\{oc\.env:(\w+)", str(entry)) for entry in entries]
    return [str(entry) for entry, names in zip(entries, needs) if all(n in os.environ for n in names)]


def _compose_theirs(directory: Path, config_name: str, searchpath: list[str], overrides: list[str]) -> DictConfig:
    from hydra.errors import HydraException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # RLinf's defaults lists leave out _self_
        try:
            return config.hydra_compose(directory, config_name,
                                        [f"hydra.searchpath=[{','.join(searchpath)}]", *overrides])
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(f"{config_name} (RLinf format): cannot compose: {config.cause(err)}") from None


def _override_key(override: str) -> str:
    """The key an override sets (``a.b=1`` -> ``a.b``); empty for group selections and
    overrides that already say how to apply (``+``, ``~``)."""
    key = override.split("=", 1)[0]
    return "" if key[:1] in "+~" or "/" in key or "@" in key else key


def _leaves(cfg: DictConfig) -> dict[str, Any]:
    """Every leaf of ``cfg`` by dotted key, resolved with RLinf's resolvers (a value whose
    interpolation fails becomes ``Unresolved``)."""
    out: dict[str, Any] = {}
    OmegaConf.register_new_resolver("not", lambda x: not bool(x), replace=True)  # RLinf's own resolver

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            try:
                child = node[key]
                if isinstance(child, DictConfig) and len(child):
                    walk(child, path + ".")
                    continue
                out[path] = OmegaConf.to_container(child, resolve=True) if isinstance(
                    child, (DictConfig, ListConfig)) else child
            except OmegaConfBaseException as err:
                out[path] = Unresolved(config.one_line(err))
    try:
        walk(cfg, "")
    finally:
        OmegaConf.clear_resolver("not")
    return out


# ------------------------------------------------------------------ translation
@dataclass
class Translation:
    """Their config carried over: our defaults list, our values (flat keys: all that were
    carried over, and those the native file writes, which our defaults list does not give
    already) and what could not be carried over (their key -> why)."""

    source: str
    defaults: list[str]
    values: dict[str, Any]
    problems: dict[str, str]
    written: dict[str, Any] = field(default_factory=dict)
    native: DictConfig | None = None  # the native file composed, when it composes

    def message(self) -> str:
        """All problems in one message, one line per key (keys of one rule on a node together)."""
        lines = [f"  - {key} {why}" for key, why in self.problems.items()]
        return (f"{self.source} (RLinf format): {len(lines)} setting(s) cannot be carried over; "
                f"override them on the command line with their RLinf key, or edit the RLinf file "
                f"(--print-config writes the native config):\n" + "\n".join(lines))

    def native_yaml(self) -> str:
        """The native experiment file: our defaults list and the translated values."""
        header = [f"# {self.source}, translated from RLinf's format by embodied-train --print-config.",
                  "# Composes from any folder: the search path below finds this framework's config/."]
        if self.problems:
            header.append("# Not carried over (fix these in the RLinf file, or set them here):")
            header += [f"#   {key} {why}" for key, why in self.problems.items()]
        sections = list(dict.fromkeys(key.split(".")[0] for key in schema.leaves()))  # base.yaml's order
        ordered = sorted(self.written.items(), key=lambda item: sections.index(item[0].split(".")[0]))
        body = {"defaults": [*self.defaults, "_self_"],
                "hydra": {"searchpath": [f"file://{schema.CONFIG_DIR}"]}, **_nest(dict(ordered))}
        return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, width=100)


def translate(leaves: Mapping[str, Any], source: str) -> Translation:
    """Their resolved leaves -> our defaults list and values, and every problem at once."""
    leaves = {k: v for k, v in leaves.items() if not _moved_away(k, leaves)}
    leaves = {**leaves, **_unwritten(leaves)}
    their = Their(leaves, "")
    model = MODEL_TYPES.get(their.model_type)
    defaults = _defaults(their, model)
    skeleton = _skeleton(source, defaults, model)
    values: dict[str, Any] = _rlinf_behaviour(their)
    problems: dict[str, str] = {}
    nodes: dict[str, list[str]] = {}  # a node's rule that refuses: its keys, reported together
    known = schema.leaves(model)
    for key, value in leaves.items():
        found, at = rule_for(key), Their(leaves, key)
        try:
            if isinstance(value, Unresolved):
                raise Untranslatable(f"cannot resolve it: {value.error}")
            if found is None:
                values.update(_as_is(key, value, known, skeleton))
                continue
            pattern, rule, rest = found
            if isinstance(rule, Implied) and rest:  # a node's rule: one line for all its keys
                if not at.unused and not rule.accepts(value, at):
                    nodes.setdefault(pattern, []).append(key)
                continue
            values.update(rule.apply(value, at, rest))
        except Untranslatable as err:
            problems[key] = f"{_shown(value)}: {err}"
    for pattern, keys in nodes.items():
        problems[f"{pattern}.*"] = f"({len(keys)} keys): {RLINF_KEYS[pattern].why}"
    translation = Translation(source, defaults, values, problems, written=_pruned(values, skeleton))
    _check(translation, values, known)
    return translation


def _check(translation: Translation, values: Mapping[str, Any], known: Mapping[str, schema.Leaf]) -> None:
    """Our usual checks of the translated values, all at once, added to its problems: each
    key's rule from the schema, composition, and the keys that never work here
    (``embodied.config.refused``) set to anything but their default, resolved in the translated config
    as the refusal resolves it. Keeps the composed config as ``translation.native``."""
    problems = translation.problems
    for key, value in values.items():
        leaf = known.get(key)
        if leaf is not None and leaf.rule is not None and not leaf.rule.allows(value):
            problems[key] = f"{_shown(value)}: expected {leaf.rule.expected()}"
    try:
        translation.native = compose_native(translation)
    except ConfigError as err:
        if not problems:  # otherwise it fails for one of them
            problems["(the translated config)"] = f"does not compose: {err}"
        return
    scratch = OmegaConf.create(OmegaConf.to_container(translation.native))
    for key, value in values.items():
        why = refusal(key)
        if why is None or key in problems:
            continue
        scratch["_default_"] = known[key].default if key in known else None
        if value != scratch["_default_"]:
            problems[key] = f"{_shown(value)}: not supported: {why}"


def _moved_away(key: str, leaves: Mapping[str, Any]) -> bool:
    for old, new in MOVED.items():
        if (key == old or key.startswith(old + ".")) and any(k == new or k.startswith(new + ".") for k in leaves):
            return True
    return False


def _unwritten(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Values RLinf's code takes for keys its configs may leave out, where ours differ: its
    reasoning runner's batch options, the OpenVLA-OFT variant, and the actor's model, which
    its Megatron math configs name under rollout.model only."""
    their, out = Their(leaves, ""), {}
    if their.reasoning:
        out |= {"algorithm.training_batch_size_per_gpu": 1, "algorithm.n_minibatches": 1}
    if their.model_type == "openvla_oft":
        out["actor.model.implement_version"] = "rlinf"
    for name in ("model_type", "model_path"):
        if f"rollout.model.{name}" in leaves:
            out[f"actor.model.{name}"] = leaves[f"rollout.model.{name}"]
    return {key: value for key, value in out.items() if key not in leaves}


def _rlinf_behaviour(their: Their) -> dict[str, Any]:
    """What RLinf's code does with no key for it, where we have a key (the keys its configs set
    come on top): LIBERO's 15 settle steps after a reset (gripper command 0 without
    reset_gripper_open) and its gripper convention for OpenVLA-OFT."""
    out: dict[str, Any] = {}
    for split in SPLITS:
        if their.env_type(split) == "libero":
            out[f"env.{split}.init_params.num_settle_steps"] = 15
            out[f"env.{split}.init_params.reset_gripper_open"] = False  # unset: a 0 gripper command
            if their.model_type == "openvla_oft":  # rlinf/envs/action_utils.py: sign(2g - 1) * -1
                out |= {"actor.model.normalize_gripper": True, "actor.model.invert_gripper": True}
    return out


def _defaults(their: Their, model: str | None) -> list[str]:
    """Our defaults list: the schema, an env group per split, the model group."""
    out = ["base"]
    if their.reasoning:
        out += ["env/math_train@env.train", "env/math_val@env.eval", "env/math_val_pass_k@env.eval_pass_k"]
    for split in SPLITS if not their.reasoning else ():
        kind = their.env_type(split)
        if kind == "libero":
            suite = their.get(f"env.{split}.task_suite_name")
            group = f"libero_{suite[len('libero_'):]}" if isinstance(suite, str) and suite.startswith("libero_") else ""
            out.append(f"env/{group if (schema.CONFIG_DIR / 'env' / f'{group}.yaml').exists() else 'libero_base'}"
                       f"@env.{split}")
        elif kind == "maniskill":
            out.append(f"env/maniskill_pick_cube@env.{split}")  # every option of our ManiSkill adapter
    if model:
        out.append(f"model/{model}@actor.model")
    return out


def _skeleton(source: str, defaults: list[str], model: str | None) -> DictConfig:
    """What our defaults list alone gives (to tell the translated values that change it). Without
    a model of ours (already a problem) the schema's defaults may not resolve: then nothing."""
    try:
        return compose_native(Translation(source, defaults, {}, {}))
    except ConfigError:
        if model is not None:
            raise
        return OmegaConf.create({})


def _as_is(key: str, value: Any, known: Mapping[str, schema.Leaf], skeleton: DictConfig) -> dict[str, Any]:
    """A key without a rule: ours when the schema (or, for simulator options, our env group)
    has it; anything else has no counterpart here."""
    parts = key.split(".")
    if key in known:
        return {key: value}
    if len(parts) > 3 and parts[0] == "env" and parts[2] == "init_params":
        ours = OmegaConf.select(skeleton, ".".join(parts[:3]), default=None) or {}
        if parts[3] in ours:
            return {key: value}
        if not ours:
            raise Untranslatable("an option of an env that has no counterpart here")
        kind = OmegaConf.select(skeleton, f"env.{parts[1]}.env_type")
        raise Untranslatable(f"not an init_params option of the {kind} env here (its options: {', '.join(ours)})")
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.85)
    raise Untranslatable("no counterpart here" + (f"; did you mean {near[0]}?" if near else ""))


def _pruned(values: Mapping[str, Any], skeleton: DictConfig) -> dict[str, Any]:
    """Leave out values that our defaults list already gives as a literal (an interpolated
    default is kept literal, since what it refers to may change)."""
    raw = OmegaConf.to_container(skeleton, resolve=False)
    out = {}
    for key, value in values.items():
        node: Any = raw
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING or node != value or isinstance(node, str) and "${" in node:
            out[key] = value
    return out


_MISSING = object()


def _shown(value: Any) -> str:
    """How a problem line shows their value after the key."""
    return f"= {value!r}" if not isinstance(value, Unresolved) else "(unresolved)"


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


# ------------------------------------------------------------------ entry points of the CLI
def read(config_dir: str | Path, config_name: str, overrides: Sequence[str] = ()) -> Translation:
    """Compose and translate an RLinf experiment (overrides in their key space)."""
    return translate(their_leaves(config_dir, config_name, overrides), config_name)


def compose(config_name: str, overrides: Sequence[str], config_dir: str | Path) -> DictConfig:
    """An RLinf experiment as our composed, schema-checked config; everything that cannot be
    carried over stops it with one ``ConfigError`` that lists it all."""
    translation = read(config_dir, config_name, overrides)
    if translation.problems:
        raise ConfigError(translation.message())
    return translation.native


def compose_native(translation: Translation) -> DictConfig:
    """The translated experiment composed and schema-checked as ``embodied.config.compose``
    does any config of ours: its file written to a temporary folder (it searches our config/)."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / f"{NATIVE_NAME}.yaml").write_text(translation.native_yaml())
        return config.compose(NATIVE_NAME, (), folder)
