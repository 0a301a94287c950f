"""Math runs beside the learning ones (test_math_pipeline.py), each a few steps through Ray, the
env / rollout / actor workers and channels: LoRA with a KL to the adapters-off reference trains and
checkpoints its peft adapter, which embodied-eval and resume read; pass@k comes per file from
validation and embodied-eval; PPO trains a value head on the causal LM; REINFORCE++ with its KL in
the rewards and truncated importance-sampling weights updates the policy; a vLLM weight sync that
misses the adapters stops the run. (A module of its own so that the suite's processes run it
beside the long learning module, not after it.) A short math run is mostly its start (three Ray
workers importing torch, transformers and the project, ~7-9 CPU-s each here; the two steps and two
validations of the LoRA run take ~2 s), so the LoRA and pass@k tests share one run."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from embodied import checkpoint
from tests.runs import ONE_RANK_EACH
from tests.test_math_pipeline import ROOT, _embodied, _math, needs_vllm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module")
def lora_run(tiny_math, ray_session, tmp_path_factory):
    """Two steps of LoRA with a KL to the adapters-off reference, validated before the first and
    after the last with pass@4 on (a run of three workers less: the pass@k test reads it too; it
    had a 1-step run of its own, 26-29 s here). Measured in two back-to-back pairs beside others'
    load, the two tests' process trees: 112 and 131 CPU-s with two runs, 115 and 119 with one (Ray
    workers 88 -> 72 CPU-s in the second pair); the gain is within this machine's noise."""
    out = tmp_path_factory.mktemp("lora")
    args = _math(tiny_math, out, "lora", *ONE_RANK_EACH, "runner.max_epochs=2", "runner.val_check_interval=2",
                 "data.val_pass_k=4", "actor.model.is_lora=true", "actor.model.lora_rank=4",
                 "data.rollout_batch_size=8", "actor.micro_batch_size=32",
                 "actor.global_batch_size=64",  # one update per step: step 1 sees the untouched adapters
                 "algorithm.kl_beta=0.1", "algorithm.use_kl_in_reward=false",
                 "algorithm.loss_agg_func=seq-mean-token-sum-norm", "algorithm.norm_adv_by_std_in_grpo=false",
                 "algorithm.entropy_bonus=0.01", "algorithm.clip_ratio_high=0.28", "algorithm.clip_ratio_c=3.0")
    result, done = _embodied("train", args)
    return args, result, done, out / "lora"


def test_lora_with_kl_trains_and_its_adapter_checkpoint_evaluates_and_resumes(tiny_math, lora_run):
    from tests.test_pipeline import scalars

    args, _, _, run = lora_run
    kl = scalars(run, "actor/kl")
    assert sorted(kl) == [1, 2] and kl[1] == pytest.approx(0.0, abs=1e-6) and kl[2] > 0  # the adapters moved
    assert all(v > 0 for v in scalars(run, "actor/entropy").values())

    # the checkpoint holds only the adapter, in peft's layout, which peft itself loads
    folder = checkpoint.latest(run / "checkpoints")
    adapter = folder / "actor" / "lora_adapter"
    assert sorted(p.name for p in (folder / "actor").iterdir()) == ["lora_adapter", "optimizer.pt"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.arithmetic import greedy_accuracy, read_jsonl

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_math["model"]), adapter)
    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    in_process = greedy_accuracy(model, tokenizer, read_jsonl(tiny_math["data"] / "test.jsonl"), max_new_tokens=4)

    # embodied-eval reads it (in Ray rollout workers) and scores what peft's model scores in process;
    # with data.val_pass_k it also reports pass@4 per data file
    result, _ = _embodied("eval", args + [f"runner.ckpt_path={folder}"])
    assert result["episodes"] == 200 and set(result["tasks"]) == {"test"}
    assert result["eval_success"] == pytest.approx(in_process)
    sampled = result["pass_at_k"]
    assert sampled["k"] == 4 and sampled["tasks"] == {"test": {"success": sampled["success"], "episodes": 800}}
    # a prompt passes when any of its 4 samples is verified: at least the mean of the samples
    assert 0 < sampled["sampled_success"] <= sampled["success"] <= 1

    # resume continues from the adapter: step 3's KL is not the fresh adapters' 0 (no validation:
    # the pass@k test reads the first run's)
    result, done = _embodied("train", [*args, "runner.max_epochs=3", "runner.val_check_interval=-1",
                                       "runner.resume_dir=auto"])
    assert f"resumed from {folder} at step 2" in done.stdout
    kl = scalars(run, "actor/kl")
    assert sorted(kl) == [1, 2, 3] and kl[3] > 0
    assert checkpoint.latest(run / "checkpoints").name == "global_step_3"


def test_reinforce_plus_plus_baseline_with_its_kl_in_the_rewards_and_truncated_is_weights_trains(tiny_math, tmp_path):
    """``algorithm.adv_type: reinpp_baseline`` with ``kl_beta`` in the rewards (the KL reference a
    frozen copy of the first weights) and ``importance_sampling_fix``: every step updates the
    policy with finite losses, and every weight is truncated at a clip below 1 (the actor's
    recomputed log-probs are the rollout's here, so each weight is 1 before the clip).
    REINFORCE++'s learning beside GRPO's is measured in benchmarks/README.md."""
    from tests.test_pipeline import scalars

    args = _math(tiny_math, tmp_path, "reinpp", *ONE_RANK_EACH, "runner.max_epochs=3", "runner.val_check_interval=-1",
                 "runner.val_before_train=false", "algorithm.adv_type=reinpp_baseline", "algorithm.kl_beta=0.01",
                 "algorithm.importance_sampling_fix=true", "algorithm.importance_sampling_clip=0.5")
    _embodied("train", args)
    loss, norm, weight, cut = (scalars(tmp_path / "reinpp", f"actor/{k}")
                               for k in ("policy_loss", "grad_norm", "is_weight", "is_truncated_fraction"))
    assert sorted(loss) == [1, 2, 3] and all(math.isfinite(v) for v in loss.values())
    assert all(0 < v < math.inf for v in norm.values()), norm
    assert set(weight.values()) == {0.5} and set(cut.values()) == {1.0}


def test_pass_at_k_per_file_from_periodic_validation(lora_run):
    from tests.test_pipeline import scalars

    _, result, done, run = lora_run
    sampled = result["pass_at_k"]
    assert sampled["k"] == 4 and sampled["tasks"] == {"test": {"success": sampled["success"], "episodes": 800}}
    assert 0 < sampled["sampled_success"] <= sampled["success"] <= 1
    for tag in ("eval_pass_k/success_once", "eval_pass_k/success_once/test", "eval/success_once"):
        assert sorted(scalars(run, tag)) == [0, 2], tag  # before training and at the last step
    assert scalars(run, "eval_pass_k/success_once")[2] == pytest.approx(sampled["success"])
    assert "  sampled: pass@k" in done.stdout and "  test: pass@k" in done.stdout


def test_ppo_trains_a_value_head_on_the_causal_lm(tiny_math, tmp_path):
    """``algorithm.adv_type: gae`` with ``actor.model.add_value_head``: the critic reads the
    prompt's last hidden state and learns the rewards of the warm-started model's answers (its
    value loss falls and it explains part of the returns' variance) while the policy trains."""
    from statistics import mean

    from tests.test_pipeline import scalars

    args = _math(tiny_math, tmp_path, "ppo", *ONE_RANK_EACH, "runner.max_epochs=15", "runner.val_check_interval=-1",
                 "runner.val_before_train=false", "algorithm.adv_type=gae", "actor.model.add_value_head=true")
    _embodied("train", args)
    loss, explained = (scalars(tmp_path / "ppo", f"critic/{k}") for k in ("value_loss", "explained_variance"))
    assert sorted(loss) == list(range(1, 16)) and all(math.isfinite(v) for v in loss.values())
    assert mean(loss[s] for s in range(11, 16)) < 0.8 * mean(loss[s] for s in range(1, 4)), loss
    assert mean(explained[s] for s in range(11, 16)) > 0.05, explained


@needs_vllm
def test_a_weight_sync_that_misses_the_adapters_stops_the_run(tiny_math, ray_session, tmp_path):
    """A sync that leaves the LoRA adapters out of the engine (the engine keeps sampling the base)
    is caught by the check after the sync: the run stops naming the step and the gap, and the
    last checkpoint is intact. (No restarts: each would start the engine again to fail the same way.)

    The hook patches the sync only in the processes that import it: when it imported torch and the
    project at every interpreter start, each of the ~10 Python processes torch's inductor starts
    to probe the CPU's vector ISAs in the vLLM engine's worker (and Ray's agents, the scorers)
    paid ~2 CPU-s for it (19 CPU-s in all, against 1.8 now). The run joins the session's Ray cluster
    instead of starting one of its own. Together, alone on the 2-core VM under others' load: the
    test's process tree 113-146 -> 68-75 CPU-s (the math fixture's ~20 included), its call 159-270
    -> 49-83 s; a start of its own cluster also timed out once under load (Ray's "node timed out
    during startup")."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent('''
        """Test hook, in every process of the run: the engine's weight sync zeroes the adapters'
        lora_B, so the engine serves the base model whatever the actor learns. Applied when a
        process imports policies.engines.weights: the run's other Python processes (Ray's agents,
        the scorers, torch's ISA probes) start without importing torch for it."""
        import importlib.abc
        import importlib.machinery
        import sys


        def without_adapters(weights):
            import torch

            merge = weights.SyncLayout.engine_state

            def engine_state(self, state):
                return merge(self, {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in state.items()})

            weights.SyncLayout.engine_state = engine_state


        class Patch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "policies.engines.weights":
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                load = spec.loader.exec_module
                spec.loader.exec_module = lambda module: (load(module), without_adapters(module))
                return spec


        sys.meta_path.insert(0, Patch())
    '''))
    args = _math(tiny_math, tmp_path, "broken", *ONE_RANK_EACH, "runner.max_epochs=2", "runner.val_check_interval=-1",
                 "runner.val_before_train=false", "runner.save_interval=1", "actor.model.is_lora=true",
                 "actor.model.lora_rank=4", "actor.optim.lr=0.05", "runner.max_restarts=0",
                 "rollout.enforce_eager=true")  # no compile: the check, not the engine's speed, is tested
    # the run is a driver of its own (the hook must be there when its processes start) on the
    # session's Ray cluster, whose workers for it start with the hook on their path as well
    # (the runtime env that `ray job submit` hands its drivers)
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    path = f"{hooks}{os.pathsep}{ROOT}"
    job = json.dumps({"runtime_env": {"env_vars": {"PYTHONPATH": path}}})
    env = {**os.environ, "PYTHONPATH": path, "RAY_ADDRESS": ray_session, RAY_JOB_CONFIG_JSON_ENV_VAR: job}
    done = subprocess.run([sys.executable, "-m", "embodied", "train", "--config-name", "math_grpo_tiny_vllm", *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert "step 2: after the weight sync the vllm engine's log-probs of the probe batch differ from the actor's by" \
        in error, error
    assert checkpoint.latest(tmp_path / "broken" / "checkpoints").name == "global_step_1"
