"""Math GRPO end to end through Ray, the env / rollout / actor workers, channels and FSDP2 (gloo,
two ranks), and learning: greedy validation inside real env workers scores exactly what the model
scores in process (math-verify works there), a shortened training run clearly raises held-out
accuracy, and the Megatron backend and vLLM rollouts learn as it does. The shorter runs (LoRA,
pass@k, PPO, the vLLM weight-sync check) are in test_math_variants.py."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.runs import embodied

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
ROOT = Path(__file__).resolve().parents[1]


def _math(tiny_math, out, name, *extra):
    return [f"actor.model.model_path={tiny_math['model']}",
            f"data.train_data_paths=[{tiny_math['data'] / 'train.jsonl'}]",
            f"data.val_data_paths=[{tiny_math['data'] / 'test.jsonl'}]",
            f"runner.output_dir={out}", f"runner.experiment_name={name}", *extra]


def _embodied(command, args, config="math_grpo_tiny"):
    return embodied(command, ["--config-name", config, *args])


LEARNING_STEPS = 160
# math_grpo_tiny's rate (1e-3) learns on some CPUs and not on others (float kernels differ): on a
# Xeon with AVX-512 FP16 / AMX its training reward stays flat over these steps (-0.62 -> -0.63,
# held-out 0.16 -> 0.185), at 3e-4 it rises as the numbers below say (-0.63 -> -0.40, 0.16 -> 0.26)

# The Megatron and vLLM runs stop at step 60 and compare steps 41-60 with the FSDP2 run's. Measured
# here (data.seed 1234, 1235, 1236): the mean reward of steps 41-60 rose by 0.14-0.15 from steps
# 1-20 for FSDP2, 0.14 for Megatron (1234, 1235), 0.13-0.17 for vLLM, each within 0.02 of FSDP2's
# with the same seed; held out after 60 steps (1234): 0.19 -> 0.235 Megatron, 0.225 vLLM. FSDP2's
# own held-out gain needs more steps (+0.045 at 100 with seed 1235), hence its 160.
COMPARED_STEPS = 60


def learning_run(tiny_math, out, *extra, steps: int = LEARNING_STEPS, config: str = "math_grpo_tiny"):
    """A shortened math_grpo_tiny run that validates before and after ``steps`` steps."""
    schedule = [f"runner.max_epochs={steps}", f"runner.val_check_interval={steps}", "actor.optim.lr=3e-4"]
    return _embodied("train", _math(tiny_math, out, "learn", *schedule, *extra), config=config)


def rises_like(ours: dict[int, float], theirs: dict[int, float], tolerance: float) -> None:
    """Steps 41-60's mean reward is >= 0.1 above steps 1-20's and within ``tolerance`` of theirs."""
    from statistics import mean

    start, end = range(1, 21), range(COMPARED_STEPS - 19, COMPARED_STEPS + 1)
    assert mean(ours[s] for s in end) >= mean(ours[s] for s in start) + 0.1, ours
    assert mean(ours[s] for s in end) == pytest.approx(mean(theirs[s] for s in end), abs=tolerance)


@pytest.fixture(scope="session")
def fsdp_learning(tiny_math, tmp_path_factory):
    """The FSDP2 learning run, shared with the Megatron test that compares its curve to it."""
    out = tmp_path_factory.mktemp("learn_fsdp")
    result, done = learning_run(tiny_math, out)
    return result, done, out / "learn"


def test_shortened_training_clearly_raises_held_out_accuracy(tiny_math, fsdp_learning):
    result, done, run = fsdp_learning
    # validation in Ray env workers (threads, spawned scorers) scores what the model scores in process
    assert result["eval_success_before"] == pytest.approx(tiny_math["accuracy"])
    assert result["eval_success"] >= result["eval_success_before"] + 0.05, result
    assert f"eval at step {LEARNING_STEPS}: success" in done.stdout and "  test: success" in done.stdout
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, LEARNING_STEPS}
    assert set(samples[0]) == {"step", "split", "prompt", "response", "answer", "reward"}


def test_megatron_backend_learns_like_fsdp(tiny_math, fsdp_learning, tmp_path):
    """``actor.training_backend=megatron`` through the same pipeline (a Megatron-Core GPTModel, here
    tensor parallel 1 x data parallel 2 over gloo, the same minibatches per rank as FSDP2's two
    replicas; weights synced to the HF rollout policy): its first rollout is the FSDP2 run's, and
    its training reward rises as much. (Tensor parallel 2 is what test_megatron.py runs over two
    gloo processes, TP 2 == TP 1 == HF step for step; through this pipeline it takes 4x the step
    time of the FSDP2 run on 2 cores, each rank computing the whole batch. A 200-prompt eval is too
    noisy to compare runs, the mean reward of 20 steps x 512 responses is not.)"""
    from tests.test_pipeline import scalars

    fsdp_result, _, fsdp_run = fsdp_learning
    result, _ = learning_run(tiny_math, tmp_path, "actor.training_backend=megatron",
                             "actor.model.tensor_model_parallel_size=1", steps=COMPARED_STEPS)
    assert result["eval_success_before"] == fsdp_result["eval_success_before"]
    assert result["eval_success"] > result["eval_success_before"], result
    ours, fsdp = scalars(tmp_path / "learn", "train/return"), scalars(fsdp_run, "train/return")
    assert sorted(ours) == list(range(1, COMPARED_STEPS + 1)) and sorted(fsdp) == list(range(1, LEARNING_STEPS + 1))
    assert ours[1] == fsdp[1]  # the same weights sampled the same first rollout
    rises_like(ours, fsdp, tolerance=0.05)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (bash scripts/setup.sh installs it)")


@needs_vllm
def test_vllm_rollouts_learn_like_huggingface_generate(tiny_math, fsdp_learning, tmp_path):
    """``math_grpo_tiny_vllm``: the same run with rollouts from a vLLM engine in each Ray rollout
    worker (weights pushed in place and checked every step): the training reward rises as with
    Hugging Face ``generate``. The engines sample with their own random streams, so the runs
    differ from the first step and compare as two seeds do: measured here, the reward of steps
    41-60 was -0.480, -0.478 and -0.478 for three HF runs (data.seed 1234, 1235, 1236) and
    -0.478, -0.492, -0.460 for vLLM, each rising >= 0.12 from steps 1-20."""
    from tests.test_pipeline import scalars

    fsdp_result, _, hf_run = fsdp_learning
    result, _ = learning_run(tiny_math, tmp_path, steps=COMPARED_STEPS, config="math_grpo_tiny_vllm")
    assert result["eval_success_before"] == fsdp_result["eval_success_before"]  # greedy: the same answers
    assert result["eval_success"] > result["eval_success_before"], result
    rises_like(scalars(tmp_path / "learn", "train/return"), scalars(hf_run, "train/return"), tolerance=0.1)
    gaps = scalars(tmp_path / "learn", "rollout/sync_logprob_gap")
    assert sorted(gaps) == list(range(2, COMPARED_STEPS + 1)) and max(gaps.values()) < 1e-3
