"""Keys of the schema that nothing reads here, and why: a key set to anything but its default
where it has no effect stops the command before anything starts with one line,
``<key>: not supported: <what>, because <why>``.

``REFUSED`` lists the keys that never work in this framework (they stay in the schema so that
configs written for the reference load when they leave them alone); ``not_read_here`` the keys
that only some models, heads, envs, losses or estimators read, as the policies
(``Policy.unread_keys``, ``refused_keys``) and the registries' entries (``reads``) declare them.
Every other key of the schema is read by the code that declares it in ``CONFIG_KEYS``
(tests/test_schema.py holds that invariant).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError
from core.registry import load
from embodied.backends import BACKENDS
from embodied.config import schema
from embodied.algorithms import ADVANTAGES, POLICY_LOSSES
from envs import ENVS
from policies import POLICIES

ARCHITECTURE = "an architecture flag, because a model's architecture comes from its checkpoint's config.json"
_NO_DDP = ("because the Megatron backend trains with a plain torch optimizer and its own gradient all-reduce, "
           "not Megatron's DDP and DistributedOptimizer (which reject CPU tensors by type string, "
           "distrib_optimizer.py:420,431), and FSDP2 shards the optimizer state by itself")
_PIPELINE = ("because the Megatron backend runs the whole model on every tensor-parallel rank (pipeline stages "
             "need Megatron's forward-backward schedule, whose p2p buffers assume CUDA)")
_MEGATRON_CKPT = ("because the Megatron backend's checkpoints are always dist_checkpointing folders, reshardable "
                  "across tensor-parallel sizes, and its weights come from actor.model.model_path")
# Keys of the reference's Megatron configs that no training backend here reads
# (actor.training_backend megatron reads the others: policies/megatron/__init__.py READ)
MEGATRON_NEVER: dict[str, str] = {
    "actor.mcore_gpt": "other stacks than Megatron-Core's GPTModel, because only it is implemented",
    "actor.spec_name": "other specs than decoder_gpt, because the GPT decoder spec is the only one",
    "actor.enable_dp_load_balance": "data-parallel load balancing, because micro-batches hold "
                                    "actor.micro_batch_size samples",
    "actor.model.pipeline_model_parallel_size": "pipeline parallelism, " + _PIPELINE,
    "actor.model.batch_p2p_comm": "pipeline communication, " + _PIPELINE,
    "actor.model.variable_seq_lengths": "pipeline shape exchange, " + _PIPELINE,
    "actor.model.encoder_seq_length": "an encoder length, because the GPT models are decoder-only",
    "actor.model.moe_token_dispatcher_type": "MoE dispatch, because no mixture-of-experts family is mapped",
    "actor.model.add_bias_linear": ARCHITECTURE,
    "actor.model.add_qkv_bias": ARCHITECTURE,
    "actor.optim.overlap_grad_reduce": "Megatron DDP's overlap, " + _NO_DDP,
    "actor.optim.overlap_param_gather": "Megatron's parameter gather, " + _NO_DDP,
    "actor.optim.overlap_param_gather_with_optimizer_step": "Megatron's parameter gather, " + _NO_DDP,
    "actor.optim.optimizer_enable_pin": "Megatron's optimizer offload, " + _NO_DDP,
    "actor.megatron.ddp_bucket_size": "Megatron DDP's buckets, " + _NO_DDP,
    "actor.megatron.ckpt_format": "other formats, " + _MEGATRON_CKPT,
    "actor.megatron.use_dist_ckpt": "choosing the format, " + _MEGATRON_CKPT,
    "actor.megatron.use_hf_ckpt": "other weight sources, " + _MEGATRON_CKPT,
    "actor.megatron.ckpt": "Megatron's offline converter, " + _MEGATRON_CKPT,
    "actor.megatron.tp_comm_bootstrap_backend": "TransformerEngine's TP communication overlap, because it "
                                                "needs CUDA, NCCL and TransformerEngine userbuffers",
    "actor.megatron.tp_comm_overlap_cfg": "TransformerEngine's TP communication overlap, because it needs "
                                          "CUDA, NCCL and TransformerEngine userbuffers",
}
FSDP1 = "an FSDP1 option, because the actor runs FSDP2 (fully_shard)"
PER_GPU = ("per-device batch sizes, because training micro-batches are actor.micro_batch_size samples "
           "and rollouts run whole env stages")
REFUSED: dict[str, str] = {
    "runner.enable_dynamic_batch_size": "token-budget micro-batches, because micro-batches hold "
                                        "actor.micro_batch_size samples",
    "runner.max_tokens_per_mbs": "token-budget micro-batches, because micro-batches hold "
                                 "actor.micro_batch_size samples",
    "algorithm.n_minibatches": "setting the updates per batch, because they follow from "
                               "actor.global_batch_size (samples per step / global_batch_size)",
    "algorithm.val_rollout_batch_size_per_gpu": PER_GPU,
    "algorithm.training_batch_size_per_gpu": PER_GPU,
    "algorithm.rollout_batch_size_per_gpu": PER_GPU,
    "algorithm.length_params": "token length limits of embodied generation, because an action chunk "
                               "is always num_action_chunks x action_dim tokens",
    "data.type": "other dataset families than math, because the text env verifies math answers",
    "env.eval.max_steps_per_rollout_epoch": "an evaluation window, because an evaluation runs whole episodes "
                                            "(max_episode_steps)",
    "env.eval_pass_k.max_steps_per_rollout_epoch": "an evaluation window, because an evaluation runs whole "
                                                   "episodes (max_episode_steps)",
    "data.num_workers": "data loader workers, because the text env workers read the prompts",
    "rollout.mode": "choosing the mode, because it follows from cluster.component_placement "
                    "(collocated, disaggregated or hybrid, printed at start)",
    "rollout.channel.name": "a channel of its own, because env, rollout and actor share env.channel.name",
    "rollout.model.model_path": "a rollout model of its own, because rollout workers run actor.model with "
                                "the weights the actor syncs every step",
    "rollout.model.model_type": "a rollout model of its own, because rollout workers run actor.model with "
                                "the weights the actor syncs every step",
    "rollout.detokenize": "detokenized rollouts, because the text env decodes responses itself "
                          "(validation samples go to samples.jsonl in runner.logger.log_path)",
    "rollout.print_outputs": "printing rollouts, because validation samples go to samples.jsonl in "
                             "runner.logger.log_path",
    "rollout.validate_weight": "weight comparison dumps, because they are not implemented",
    "rollout.validate_save_dir": "weight comparison dumps, because they are not implemented",
    "actor.channel.name": "a channel of its own, because env, rollout and actor share env.channel.name",
    **MEGATRON_NEVER,
    "actor.calculate_flops": "FLOP counting, because it is not implemented",
    "actor.tokenizer.tokenizer_type": "other tokenizer types, because tokenizers load with Hugging Face "
                                      "AutoTokenizer",
    "actor.tokenizer.extra_vocab_size": "extra vocabulary, because the tokenizer's vocabulary is the "
                                        "checkpoint's",
    "actor.tokenizer.padding_side": "right padding, because prompts are left-padded for batched generation",
    "actor.fsdp_config.strategy": "FSDP1, because only FSDP2 (fully_shard) is implemented",
    "actor.fsdp_config.enable_gradient_accumulation": FSDP1 + ", which syncs only the last micro-batch",
    "actor.fsdp_config.forward_prefetch": FSDP1 + ", which prefetches by itself",
    "actor.fsdp_config.limit_all_gathers": FSDP1,
    "actor.fsdp_config.backward_prefetch": FSDP1 + ", which prefetches by itself",
    "actor.fsdp_config.use_orig_params": FSDP1 + ", which always keeps the original parameters",
    "actor.fsdp_config.use_liger_kernel": "Liger kernels, because they need CUDA and no policy uses them",
    "actor.fsdp_config.fsdp_size": "hybrid sharding, because shard groups smaller than the actor "
                                   "are not implemented",
    "actor.fsdp_config.mixed_precision.buffer_dtype": "a buffer dtype, because FSDP2 keeps buffers "
                                                      "in their own dtype",
    "reward.use_reward_model": "a reward model, because rewards come from the envs (task success, "
                               "verified answers)",
    "reward.reward_type": "other reward types than math, because the text env's verifier scores math answers",
    "critic.use_critic_model": "a separate critic model, because PPO's critic here is the "
                               "policy's value head (actor.model.add_value_head)",
    # actor.model keys of the reference's configs that no policy reads
    "actor.model.val_micro_batch_size": "a value micro-batch, because values come out of the rollout's "
                                        "forward pass",
    "actor.model.policy_setup": "robot setups, because the env adapters set up the robot (no SimplerEnv "
                                "adapter exists)",
}


def not_read_here(cfg: DictConfig) -> dict[str, str | None]:
    """Keys that only some models, heads, envs, training backends, losses or estimators read, with
    why this config's do not; None marks a key read here under a node that is not
    (``data.demo_paths`` of an SFT run, whose other ``data`` keys are the text env's)."""
    model = cfg.actor.model.model_type
    options = OmegaConf.to_container(cfg.actor.model, resolve=True)
    out = POLICIES.unread(model) | POLICIES.get(model).unread_keys(options)
    backend = cfg.actor.training_backend
    out |= BACKENDS.unread(backend) | BACKENDS.get(backend).refused(cfg) | _rollout_unread(cfg)
    types = {split: cfg.env[split].get("env_type") for split in schema.ENV_SPLITS if cfg.env[split]}
    types = {split: name for split, name in types.items() if name in ENVS}
    for split, name in types.items():  # a key of a split's own env: what the others read
        for key, why in ENVS.unread(name).items():
            if key.startswith("env.*."):
                out[key.replace("*", split, 1)] = why.replace("env.*.", f"env.{split}.", 1)
    used = {key for name in types.values() for key in ENVS.reads(name)}
    for name in ENVS.names():  # a key outside env.*: unread when no split's env reads it
        for key, what in ENVS.reads(name).items():
            if not key.startswith("env.*.") and key not in used:
                readers = " or ".join(n for n in ENVS.names() if key in ENVS.reads(n))
                out[key] = f"only {readers} envs (env_type {readers}) read {what}"
    if not cfg.algorithm.importance_sampling_fix:
        out["algorithm.importance_sampling_clip"] = "algorithm.importance_sampling_fix is false (it truncates that weight)"
    unread, read = _choices(cfg)
    out |= unread
    out |= {key: None for key in read if key not in out}  # read here, though a node above may not be
    return out


def engine_keys() -> list[str]:
    """The reference's generation-engine options (``rollout.<key>``): those some model's engine
    reads (its ``rollout_keys``); the other engines refuse them with their reasons."""
    engines = [load(target) for name in POLICIES.names() for target in POLICIES.declared(name)["rollout"].values()]
    return sorted({key for engine in engines for key in engine.rollout_keys})


def _rollout_unread(cfg: DictConfig) -> dict[str, str]:
    """The engine keys this config's rollout backend does not read, with why."""
    backend = cfg.rollout.backend
    if backend == "huggingface":
        return dict.fromkeys((f"rollout.{key}" for key in engine_keys()),
                             "rollout.backend is huggingface (a generation-engine option)")
    engines = POLICIES.declared(cfg.actor.model.model_type)["rollout"]
    if backend not in engines:  # no such engine for this model: validate says so
        return {}
    critic = {"actor.model.add_value_head": f"rollout.backend {backend} computes no values (PPO's critic reads "
                                            "the rollout policy's hidden states); use rollout.backend huggingface"}
    return critic | {f"rollout.{key}": why for key, why in load(engines[backend]).refused_rollout_keys.items()}


def _choices(cfg: DictConfig) -> tuple[dict[str, str], set[str]]:
    """What the chosen loss and estimator leave unread, with why, and what they read (derived from
    the registries' ``reads``); a loss on demonstrations chooses no estimator, so every
    estimator's keys go unread."""
    loss, adv = cfg.algorithm.loss_type, cfg.algorithm.adv_type
    unread, read = POLICY_LOSSES.unread(loss), set(POLICY_LOSSES.reads(loss))
    if ADVANTAGES.config_key in read:
        unread |= ADVANTAGES.unread(adv)
        read |= set(ADVANTAGES.reads(adv))
    else:
        why = f"algorithm.loss_type {loss} computes no advantages, so no {ADVANTAGES.config_key} reads it"
        unread |= {key: why for name in ADVANTAGES.names() for key in ADVANTAGES.reads(name)}
    return unread, read


def refuse_unsupported(cfg: DictConfig) -> None:
    """Stop at the first key of ``REFUSED`` or ``not_read_here`` (or a leaf under one) set to
    anything but its schema default."""
    scratch = OmegaConf.create(OmegaConf.to_container(cfg))  # to resolve defaults such as ${a.b}/c
    known = cfg.actor.model and cfg.actor.model.model_type in POLICIES
    here = not_read_here(cfg) if known else {}
    own = {}  # what the policy refuses of its own schema
    if known:
        own = {f"actor.model.{k}": why for k, why in POLICIES.get(cfg.actor.model.model_type).refused_keys.items()}
    for path, leaf in schema.leaves(OmegaConf.select(cfg, "actor.model.model_type")).items():
        why = _under(path, REFUSED) or _under(path, own)
        where = None if why else _under(path, here)
        if why is None and where is None:
            continue
        value: Any = leaf.default
        if isinstance(value, str) and "${" in value:
            scratch["_default_"] = value
            value = scratch["_default_"]
        if OmegaConf.select(cfg, path, default=value) != value:
            if why is not None:
                raise ConfigError(f"{path}: not supported: {why}")
            raise ConfigError(f"{path}: not supported here, because {where}")


def refusal(key: str) -> str | None:
    """Why ``key`` never works (it or a node above it is in ``REFUSED``), or None."""
    return _under(key, REFUSED)


def _under(key: str, table: dict[str, str]) -> str | None:
    parts = key.split(".")
    return next((table[k] for i in range(len(parts), 0, -1) if (k := ".".join(parts[:i])) in table), None)
