"""Math configs compose and dry-run; bad input ends with one message naming the file, line or key
and exit code 2, before anything starts."""

import json

import pytest

from embodied.cli import _main


def _args(tiny_math, *extra):
    return ["--dry-run", f"actor.model.model_path={tiny_math['model']}",
            f"data.train_data_paths=[{tiny_math['data'] / 'train.jsonl'}]",
            f"data.val_data_paths=[{tiny_math['data'] / 'test.jsonl'}]", *extra]


def _run(capsys, config, args):
    code = _main(["--config-name", config, *args], "embodied-train")
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tiny_and_gpu_configs_dry_run(tiny_math, capsys):
    code, out, _ = _run(capsys, "math_grpo_tiny", _args(tiny_math))
    assert code == 0 and "config OK" in out and "64 prompts/step" in out
    code, out, _ = _run(capsys, "math_grpo_qwen2_5_1_5b", _args(
        tiny_math, "data.max_prompt_length=8", "runner.seq_length=12", "cluster.num_gpus_per_node=8",
        "actor.model.is_lora=true"))
    assert code == 0 and "actor: 8 rank(s)" in out


def test_gpu_config_requires_a_model(capsys):
    code, _, err = _run(capsys, "math_grpo_qwen2_5_1_5b", ["--dry-run", "cluster.num_gpus_per_node=2"])
    assert code == 2 and "actor.model.model_path = None" in err


def test_the_vllm_variant_dry_runs_and_sglang_is_refused_here(tiny_math, capsys):
    code, out, err = _run(capsys, "math_grpo_tiny_vllm", _args(tiny_math))
    assert code == 0, err
    code, _, err = _run(capsys, "math_grpo_tiny", _args(tiny_math, "rollout.backend=sglang"))
    assert code == 2 and err.count("\n") == 1
    assert "rollout.backend = 'sglang': not supported here, because SGLang needs a CUDA GPU" in err


@pytest.mark.parametrize("config, override, message", [
    ("math_grpo_tiny", "rollout.gpu_memory_utilization=0.9",
     "rollout.gpu_memory_utilization: not supported here, because rollout.backend is huggingface"),
    ("math_grpo_tiny_vllm", "rollout.attention_backend=fa3",
     "rollout.attention_backend: not supported here, because choosing the attention kernel"),
    ("math_grpo_tiny_vllm", "rollout.enable_offload=true", "rollout.enable_offload: not supported here, because "
                                                            "offloading the engine"),
    ("maniskill_ppo_mlp", "rollout.backend=vllm", "rollout.backend = 'vllm': expected huggingface with model_type mlp"),
])
def test_engine_options_are_read_by_the_engine_that_has_them(tiny_math, capsys, config, override, message):
    args = _args(tiny_math, override) if config.startswith("math") else ["--dry-run", override]
    code, _, err = _run(capsys, config, args)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "train.jsonl:2: not JSON (Expecting value at column 12)"),
    ('{"prompt": "1+1=", "solution": "2"}\n', "train.jsonl:1: no key 'answer' (data.answer_key)"),
    ("\n", "train.jsonl holds no records"),
    ('{"prompt": "123456789+1=", "answer": "1"}\n', "longer than data.max_prompt_length=8"),
])
def test_bad_data_exits_2_naming_file_and_line(tiny_math, tmp_path, capsys, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    code, _, err = _run(capsys, "math_grpo_tiny", _args(tiny_math, f"data.train_data_paths=[{tmp_path / 'train.jsonl'}]"))
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("override, key", [
    ("actor.model.model_path=/nonexistent/model", "actor.model.model_path"),
    ("actor.tokenizer.tokenizer_model=/nonexistent/tokenizer", "actor.tokenizer.tokenizer_model"),
    ("data.train_data_paths=[/nonexistent/train.jsonl]", "/nonexistent/train.jsonl does not exist"),
    ("actor.tokenizer.padding_side=right", "actor.tokenizer.padding_side"),
    ("data.type=code", "data.type"),
    ("algorithm.loss_agg_func=sum", "algorithm.loss_agg_func"),
])
def test_bad_paths_and_values_exit_2_naming_the_key(tiny_math, capsys, override, key):
    code, _, err = _run(capsys, "math_grpo_tiny", _args(tiny_math, override))
    assert code == 2 and key in err


def test_the_prompt_set_keys_are_read(tiny_math, tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    code, _, err = _run(capsys, "math_grpo_tiny", _args(
        tiny_math, f"data.train_data_paths=[{tmp_path / 'q.jsonl'}]", f"data.val_data_paths=[{tmp_path / 'q.jsonl'}]",
        "data.prompt_key=question",
        "data.answer_key=solution", "data.rollout_batch_size=4", "actor.global_batch_size=32",
        "actor.micro_batch_size=16"))
    assert code == 0, err


@pytest.mark.parametrize("config, override, message", [
    ("math_grpo_tiny", "data.val_pass_k=0", "data.val_pass_k = 0: expected a number >= 1"),
    ("math_grpo_tiny", "data.max_prompt_length=2048", "data.max_prompt_length = 2048: expected fewer tokens than "
                                                       "runner.seq_length (12)"),
    ("math_grpo_tiny", "data.val_pass_k=2.5", "data.val_pass_k = 2.5"),
    ("math_grpo_tiny", "data.val_pass_k=true", "data.val_pass_k = True"),
    ("math_grpo_tiny", "data.val_pass_k=4 algorithm.sampling_params.do_sample=false", "do_sample=false"),
    ("maniskill_grpo_mlp", "data.val_pass_k=4", "data.val_pass_k: not supported here, because only text or agent envs"),
])
def test_nonsense_pass_k_exits_2(tiny_math, capsys, config, override, message):
    args = _args(tiny_math, *override.split()) if config.startswith("math") else ["--dry-run", *override.split()]
    code, _, err = _run(capsys, config, args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_pass_k_split_holds_k_envs_per_validation_prompt(tiny_math):
    from embodied.cli import load

    cfg, _ = load("math_grpo_tiny", _args(tiny_math, "data.val_pass_k=4")[1:])
    split = cfg.env.eval_pass_k
    assert (split.total_num_envs, split.group_size, split.init_params.pass_at_group) == (800, 4, True)
    assert split.init_params.data_paths == cfg.env.eval.init_params.data_paths
    assert not cfg.env.eval.init_params.pass_at_group


@pytest.mark.parametrize("override", ["", "actor.model.precision=fp16 actor.optim.fp16=true",
                                      "actor.model.precision=fp16 actor.optim.fp16=true actor.optim.loss_scale=1024",
                                      "actor.model.precision=bf16 actor.optim.bf16=true",
                                      "actor.optim.use_distributed_optimizer=true algorithm.use_valid_token_scale=true"])
def test_megatron_backend_dry_runs(tiny_math, capsys, override):
    code, out, err = _run(capsys, "math_grpo_tiny", _args(tiny_math, "actor.training_backend=megatron", *override.split()))
    assert code == 0, err


@pytest.mark.parametrize("config, override, message", [
    ("math_grpo_tiny",
     "actor.training_backend=megatron actor.model.tensor_model_parallel_size=8 cluster.num_gpus_per_node=8",
     "actor.model.tensor_model_parallel_size=8 does not divide num_attention_heads"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.tensor_model_parallel_size=3",
     "actor.model.tensor_model_parallel_size=3 does not divide the actor's world size (2)"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.is_lora=true",
     "actor.model.is_lora: not supported here, because actor.training_backend megatron has no LoRA"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.fsdp_config.cpu_offload=true",
     "actor.fsdp_config.cpu_offload: not supported here, because actor.training_backend megatron does not read "
     "it (fsdp does: FSDP2's"),
    ("math_grpo_tiny", "actor.model.tensor_model_parallel_size=2",
     "actor.model.tensor_model_parallel_size: not supported here, because actor.training_backend fsdp does not "
     "read it (megatron does: TP size"),
    ("math_grpo_tiny", "actor.megatron.distributed_timeout_minutes=5", "actor.megatron.distributed_timeout_minutes"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.pipeline_model_parallel_size=2",
     "actor.model.pipeline_model_parallel_size: not supported: pipeline parallelism"),
    ("maniskill_ppo_mlp", "actor.training_backend=megatron", "actor.training_backend = 'megatron': expected fsdp "
                                                             "with model_type mlp"),
    ("math_grpo_tiny", "algorithm.use_valid_token_scale=true algorithm.loss_agg_func=seq-mean-token-mean",
     "algorithm.use_valid_token_scale: not supported with algorithm.loss_agg_func seq-mean-token-mean, because"),
    ("math_grpo_tiny", "actor.optim.use_distributed_optimizer=true", "actor.optim.use_distributed_optimizer: not "
     "supported here, because actor.training_backend fsdp does not read it (megatron does"),
    ("math_grpo_tiny", "actor.optim.fp16=true", "actor.optim.fp16: not supported here, because actor.training_backend "
                                                "fsdp does not read it (megatron does: by the actor: mixed precision"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.optim.fp16=true",
     "actor.optim.fp16 = True: expected actor.model.precision fp16 with it"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.precision=bf16 actor.optim.bf16=true "
                       "actor.optim.fp16=true", "actor.optim.fp16 and actor.optim.bf16 both true"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.precision=bf16 actor.optim.bf16=true "
                       "actor.optim.loss_scale=1024", "actor.optim.loss_scale: not supported here, because losses "
                                                     "are scaled for fp16"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.precision=fp16 actor.optim.fp16=true "
                       "actor.optim.loss_scale=1024 actor.optim.loss_scale_window=100",
     "actor.optim.loss_scale_window: not supported here, because only a dynamic fp16 loss scale has a window"),
    ("math_grpo_tiny", "actor.training_backend=megatron actor.model.precision=fp16 actor.optim.fp16=true "
                       "actor.optim.loss_scale=0", "actor.optim.loss_scale"),
])
def test_bad_megatron_settings_exit_2_naming_the_key(tiny_math, capsys, config, override, message):
    args = _args(tiny_math, *override.split()) if config.startswith("math") else ["--dry-run", *override.split()]
    code, _, err = _run(capsys, config, args)
    assert code == 2 and message in err and err.count("\n") == 1, err
