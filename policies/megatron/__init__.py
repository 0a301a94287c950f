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
- ``mixed_precision.py``: ``actor.optim.fp16`` / ``bf16``: fp32 main weights and the loss scale.
- ``distributed_optimizer.py``: ``actor.optim.use_distributed_optimizer``: the optimizer state
  sharded over the data-parallel replicas.
- ``cpu.py``: the CUDA assumptions of 0.16.1 on these paths, handled when there is no CUDA.
- ``options.py``: ``check_options``, the checks the driver runs before workers start.
- ``backend.py``: ``MegatronBackend``, the training backend the actor drives (``core/backend.py``).

The reference's Megatron keys: ``READ`` says what each key only this backend reads becomes (the
backend registry's ``reads``, refused under ``fsdp``; keys read "by the actor" are for the actor
worker to honour, the rest are read here); those no backend can honour are refused in
``embodied/config/refused.py`` (``MEGATRON_NEVER``), each with its reason. The keys every backend reads
mean here what they mean with FSDP: ``model_path`` is the HF folder the GPTModel's shapes and
weights come from, ``precision`` the parameters' dtype (TransformerConfig ``params_dtype``),
``temperature`` scales the logits of the log-probs as in ``causal_lm``, ``gradient_checkpointing``
recomputes every layer (full, uniform, one layer at a time), ``actor.optim.*`` make a plain torch
optimizer over this rank's shards (over fp32 main copies of them with ``fp16`` / ``bf16``), and
``clip_grad`` clips counting tensor-parallel shards once.
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
    "actor.optim.fp16": "by the actor: mixed precision (mixed_precision.py): the optimizer steps fp32 main "
                        "weights of the fp16 model (actor.model.precision fp16), losses scaled",
    "actor.optim.bf16": "by the actor: mixed precision: fp32 main weights of the bf16 model "
                        "(actor.model.precision bf16), no loss scale",
    "actor.optim.loss_scale": "by the actor, with fp16: a static loss scale; null: dynamic",
    "actor.optim.loss_scale_window": "by the actor, with fp16 and a dynamic loss scale: clean steps before "
                                     "the scale doubles",
    "actor.optim.use_distributed_optimizer": "by the actor: each data-parallel replica keeps and steps the "
                                             "optimizer state (and fp32 main weights) of its share of the "
                                             "parameters, and broadcasts them (distributed_optimizer.py)",
    "actor.megatron.distributed_backend": "by the actor: its process group's backend with CUDA (nccl | gloo); "
                                          "gloo without CUDA",
    "actor.megatron.distributed_timeout_minutes": "by the actor: its process group's timeout",
}
