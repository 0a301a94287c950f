"""Megatron-Core training backend of the causal LM (``actor.training_backend: megatron``),
tensor-parallel over gloo on CPU or NCCL on GPU. Pinned to ``megatron-core==0.16.1`` (the
``megatron`` extra; the last release for Python 3.11).

- ``weights.py``: HF Llama / Qwen2 <-> Megatron ``GPTModel`` weights, split and gathered over TP.
- ``model.py``: process groups, layer spec, ``TransformerConfig`` and the model from an HF folder.
- ``policy.py``: ``MegatronCausalLMPolicy``, the ``Policy`` the actor trains.
- ``training.py``: the data-parallel gradient all-reduce and TP-aware clip an actor calls
  instead of FSDP's (its docstring has the call order).
- ``vocab_parallel.py``: log-probs and entropy from vocab-sharded logits.
- ``checkpoint.py``: ``dist_checkpointing`` folders (weights and optimizer), reshardable.
- ``cpu.py``: the CUDA assumptions of 0.16.1 on these paths, handled when there is no CUDA.
- ``options.py``: ``check_options``, the checks the driver runs before workers start.

The reference's Megatron keys: ``READ`` says what each key this backend reads becomes (keys read
"by the actor" are for the actor worker to honour; the rest are read here); those no backend can
honour are refused in ``embodied/refused.py`` (``MEGATRON_NEVER``), each with its reason.
"""

import warnings

from policies.megatron.options import check_options

# Harmless on this path, printed by every rank at every start: the plain-torch fallbacks are what
# the CPU (and a GPU without TransformerEngine) runs, and the checkpoint format is Megatron's choice.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "Please use DTensor instead and we are deprecating ShardedTensor"):
    warnings.filterwarnings("ignore", message=f".*{_message}")

__all__ = ["READ", "check_options"]

READ: dict[str, str] = {
    "actor.training_backend": "megatron: this backend, for model_type causal_lm",
    "actor.model.model_path": "the HF folder the GPTModel's shapes (config.json) and weights come from",
    "actor.model.precision": "parameter dtype (TransformerConfig params_dtype, bf16 / fp16 flags)",
    "actor.model.temperature": "log-probs of log_softmax(logits / temperature), as causal_lm",
    "actor.model.max_prompt_length": "with action_dim: checked against the model's positions",
    "actor.model.gradient_checkpointing": "by the actor, through enable_gradient_checkpointing(): every layer "
                                          "recomputed (full, uniform, 1 layer); not with recompute_granularity",
    "actor.model.tensor_model_parallel_size": "TP size: Megatron's process groups (TP groups of consecutive "
                                              "ranks, data parallel over the rest); must divide the world "
                                              "size, heads, KV heads and FFN size; the vocabulary is padded "
                                              "to a multiple of it",
    "actor.model.sequence_parallel": "TransformerConfig.sequence_parallel with CUDA and TP > 1; refused without "
                                     "CUDA (0.16.1 allocates its sequence gathers on the CUDA device, "
                                     "tensor_parallel/mappings.py:141,181, layers.py:552)",
    "actor.model.recompute_granularity": "full | selective: TransformerConfig with CUDA; without CUDA "
                                         "torch.utils.checkpoint on the same parts (cpu.recompute_layers)",
    "actor.model.recompute_method": "uniform | block (with full)",
    "actor.model.recompute_num_layers": "layers per chunk (uniform) or recomputed layers (block)",
    "actor.model.seq_length": "GPTModel max_sequence_length (nothing depends on it with RoPE)",
    "actor.model.activation": "checked: swiglu (every mapped family's; the architecture is config.json's)",
    "actor.model.normalization": "checked: rmsnorm",
    "actor.model.position_embedding_type": "checked: rope",
    "actor.model.attention_softmax_in_fp32": "TransformerConfig.attention_softmax_in_fp32",
    "actor.model.use_cpu_initialization": "TransformerConfig.use_cpu_initialization (always on without CUDA)",
    "actor.model.megatron_checkpoint": "a save_checkpoint folder (any TP size) whose weights replace the HF "
                                       "folder's at start",
    **{f"actor.model.{key}": "TransformerConfig field of that name with CUDA; refused without (a fused "
                             "CUDA kernel)"
       for key in ("apply_rope_fusion", "bias_dropout_fusion", "persist_layer_norm", "bias_activation_fusion",
                   "gradient_accumulation_fusion")},
    "actor.optim.optimizer": "by the actor: a plain torch optimizer (adam | adamw | sgd) over this rank's "
                             "shards, as with FSDP (adam_beta1/2, adam_eps, weight_decay, lr likewise)",
    "actor.optim.clip_grad": "by the actor: training.clip_grad_norm (TP shards counted once)",
    "actor.megatron.distributed_backend": "by the actor: its process group's backend with CUDA (nccl | gloo); "
                                          "gloo without CUDA",
    "actor.megatron.distributed_timeout_minutes": "by the actor: its process group's timeout",
}
