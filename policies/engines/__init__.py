"""Generation engines behind the ``Policy`` interface, for the text env's rollouts
(``rollout.backend``: ``huggingface`` is ``CausalLMPolicy`` itself; ``vllm`` and ``sglang`` are here).

An engine policy stands in for the rollout worker's ``causal_lm`` policy and nothing else changes
(the model registry declares the engines of ``causal_lm``; ``embodied.config.build_rollout_policy``
builds one):

    policy = VLLMCausalLM(actor_model_options, rollout_options, cpu_threads=slots)
    out = policy.act(obs, do_sample)             # the ActOutput of CausalLMPolicy.act

and after every actor update (``policies/engines/probe.py``):

    policy.load_trainable_state_dict(state)      # actor's trainable_state_dict: in place, checked
    gap = policy.verify_sync(probe, actor_logprobs, step=step)   # rollout/sync_logprob_gap

with ``probe`` a few responses of the first rollout, kept for the run, and ``actor_logprobs`` the
actor's ``Policy.probe_logprobs`` of them after its update. A gap over the tolerance raises
``SyncMismatchError`` naming the step.

LoRA runs send only the adapters; the engine policy merges them onto its copy of the frozen base
and reloads the whole model (``policies/engines/weights.py``), rather than serving the adapter
with the engine's own LoRA support: vLLM's LoRA layers slow every generated token (2.4x at 65M
parameters on the CPU, ``benchmarks/generation.py --lora``), while a merged model generates at full
speed and costs one merge and full reload per step (1.0 s at 65M, against a 47 s rollout).
"""
