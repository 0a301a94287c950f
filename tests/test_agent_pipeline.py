"""Agent episodes through the whole pipeline (Ray, env / rollout / actor workers, FSDP2 over two
gloo ranks): skyrl-gym's gsm8k_multi_turn, unchanged, on a parquet dataset in SkyRL's layout,
trains a few GRPO steps with finite metrics, and the episodes the eval logged keep their ids
token by token: the chat template's prompt, each response verbatim up to its EOS or stop string,
each observation templated; PPO with a value head trains on the same episodes, and rollouts overlap
updates through env stages and staleness as robots' do, and an episode waiting on a slow tool
holds none of the others."""

from __future__ import annotations

import json
import math
import string

import pytest

from tests.runs import ONE_RANK_EACH, embodied
from tests.test_agent_env import CHATML

pytestmark = pytest.mark.slow
QUESTIONS = [("Tom has 3 apples and buys 4. How many?", "7"), ("What is 2+2?", "4"), ("Half of 10?", "5"),
             ("Ann had 9 pens and lost 2. How many?", "7")]
STOP = ["a", "e", "o"]
FOLLOW_UP = ("Please provide your step-by-step reasoning, and also include a tentative numeric answer at the "
             "end in the exact format: '#### ANSWER'.")


@pytest.fixture(scope="module")
def skyrl_files(tmp_path_factory):
    """A tiny chat model and gsm8k_multi_turn rows in SkyRL's layout; the arguments that run them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from policies.tiny_lm import build_model, train_tokenizer

    root = tmp_path_factory.mktemp("agent")
    tok = train_tokenizer([string.printable])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    model = build_model(len(tok), tok.pad_token_id, tok.eos_token_id, positions=512)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": q}], "env_class": "gsm8k_multi_turn",
             "reward_spec": {"method": "rule", "ground_truth": a}, "extra_info": {"max_turns": 3}}
            for q, a in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--config-name", "agent_arithmetic_tools_tiny", f"actor.model.model_path={root / 'model'}",
            f"data.train_data_paths=[{root / 'train.parquet'}]", f"data.val_data_paths=[{root / 'val.jsonl'}]",
            "env.train.init_params.game=gsm8k_multi_turn", "env.eval.init_params.game=gsm8k_multi_turn",
            "env.train.init_params.tools=[]", "env.eval.init_params.tools=[]",
            "env.train.max_episode_steps=2", "env.eval.max_episode_steps=2", "runner.max_epochs=2",
            "data.rollout_batch_size=2", "algorithm.group_size=4", "data.val_rollout_batch_size=4",
            "data.max_prompt_length=320", "runner.seq_length=352", "actor.micro_batch_size=8",
            "actor.global_batch_size=16"]
    return root, tok, args


@pytest.fixture(scope="module")
def skyrl_run(skyrl_files, ray_session):
    root, tok, args = skyrl_files
    result, _ = embodied("train", [
        *args, f"runner.output_dir={root / 'out'}", "runner.val_check_interval=2",
        # responses end at EOS, at the length limit, or at a stop string (most of them here: the
        # evaluation samples, where the greedy random model would only ever repeat one character)
        f"algorithm.sampling_params.stop=[{','.join(STOP)}]", "algorithm.sampling_params.temperature_eval=1.0"])
    return result, root / "out" / "agent_arithmetic_tools_tiny", tok


def test_skyrl_gym_env_trains_a_few_grpo_steps_with_finite_metrics(skyrl_run):
    from tests.test_pipeline import scalars

    result, run, _ = skyrl_run
    assert result["env_steps"] > 0 and 0 <= result["eval_success"] <= 1
    for tag in ("actor/policy_loss", "actor/grad_norm", "train/return", "train/turns", "eval/turns"):
        values = scalars(run, tag)
        assert values and all(math.isfinite(v) for v in values.values()), tag
    assert 1 <= scalars(run, "train/turns")[2] <= 2  # responses per episode, at most max_turns


def test_logged_episodes_keep_their_ids_token_by_token(skyrl_run):
    _, run, tok = skyrl_run
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    eos, width, stopped = tok.eos_token_id, 352 - 320, 0
    for sample in samples:
        ids, generated = sample["ids"], sample["generated"]
        assert len(ids) == len(generated) and sample["turns"] == sum(
            1 for k, g in enumerate(generated) if g and (k == 0 or not generated[k - 1]))
        runs, start = [], 0  # maximal runs of generated / not generated ids
        for k in range(1, len(ids) + 1):
            if k == len(ids) or generated[k] != generated[start]:
                runs.append((generated[start], ids[start:k]))
                start = k
        kind, prompt = runs[0]
        question = next(q for q, _ in QUESTIONS if q in tok.decode(prompt))
        templated = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        assert kind == 0 and prompt == templated
        for (kind, response), after in zip(runs[1::2], [*runs[2::2], (0, [])]):
            # a response ends at its first EOS, at the length limit, or after the token that
            # completes a stop string
            text, before = (tok.decode(r, skip_special_tokens=True) for r in (response, response[:-1]))
            assert not any(s in before for s in STOP) and eos not in response[:-1]
            assert kind == 1 and (response[-1] == eos or len(response) == width or any(s in text for s in STOP))
            stopped += response[-1] != eos and any(s in text for s in STOP)
            if after[1]:  # the message closed (by the env where no EOS closed it), the game's next one templated
                text = "<|im_end|>" * (response[-1] != eos) + f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n" \
                       "<|im_start|>assistant\n"
                assert after[1] == tok(text, add_special_tokens=False)["input_ids"]
    assert stopped > 0


def test_ppo_on_multi_turn_episodes_trains_a_critic_over_the_turns(skyrl_files, ray_session, tmp_path):
    """PPO (``algorithm.adv_type: gae``, a value head on the causal LM) on the same episodes: a
    value for each turn's context, GAE over the turns of each episode (bootstrapped where an
    episode is cut at max_turns), the critic trained beside the policy with finite figures."""
    from tests.test_pipeline import scalars

    _, _, args = skyrl_files
    # one rank per group (the skyrl_run fixture is the run on two FSDP2 ranks): 50 -> 25 s measured
    embodied("train", [*args, *ONE_RANK_EACH, f"runner.output_dir={tmp_path}", "runner.val_check_interval=-1",
                       "runner.val_before_train=false", "algorithm.adv_type=gae", "actor.model.add_value_head=true"])
    run = tmp_path / "agent_arithmetic_tools_tiny"
    assert scalars(run, "train/turns")[2] > 1  # several turns per episode
    for tag in ("critic/value_loss", "critic/explained_variance", "actor/policy_loss"):
        values = scalars(run, tag)
        assert sorted(values) == [1, 2] and all(math.isfinite(v) for v in values.values()), tag


def test_agent_rollouts_overlap_updates_as_robot_rollouts_do(skyrl_files, ray_session, tmp_path):
    """Asynchronous as for robots: two env stages per worker (one stage's games answer while the
    policy generates for the other) and rollouts one update behind the actor
    (``staleness_threshold`` 1 with the decoupled loss), with finite figures."""
    from tests.test_pipeline import scalars

    _, _, args = skyrl_files
    embodied("train", [*args, *ONE_RANK_EACH, f"runner.output_dir={tmp_path}", "runner.max_epochs=3",
                       "runner.val_check_interval=-1",
                       "runner.val_before_train=false", "data.rollout_batch_size=4", "rollout.pipeline_stage_num=2",
                       "algorithm.staleness_threshold=1", "algorithm.loss_type=decoupled_actor_critic",
                       "rollout.recompute_logprobs=false"])
    run = tmp_path / "agent_arithmetic_tools_tiny"
    assert scalars(run, "actor/version_lag") == {1: 0.0, 2: 1.0, 3: 1.0}
    overlap = scalars(run, "time/overlap")  # from step 2 on, the rollout runs while the actor updates
    assert overlap[2] > 0 and overlap[3] > 0, overlap
    for tag in ("actor/policy_loss", "actor/behave_weight", "train/return"):
        values = scalars(run, tag)
        assert sorted(values) == [1, 2, 3] and all(math.isfinite(v) for v in values.values()), tag


def test_an_episode_waiting_on_a_slow_tool_holds_none_of_the_others(skyrl_files, ray_session, tmp_path):
    """One env stage per group: each stage steps in a thread of its own as soon as its responses
    come, and the rollout generates for whichever stages are waiting. The game answers row 0's
    group's first responses after 10 s and row 1's at once: row 1's episodes play all their 3 turns before row 0's
    first answer. (In one stage, their second turn would wait for it.)"""
    root, _, args = skyrl_files
    rows = [{"prompt": f"row {i}", "row": i, "pause_s": 10.0 if i == 0 else 0.0} for i in range(2)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "answers.jsonl"
    overrides = {"data.train_data_paths": f"[{tmp_path / 'rows.jsonl'}]", "data.rollout_batch_size": "2",
                 "algorithm.group_size": "2", "env.train.max_episode_steps": "3", "runner.max_epochs": "1",
                 "env.train.init_params.game": "tests.agent_games:Pause", "data.shuffle": "false"}
    args = [a for a in args if a.split("=")[0] not in overrides] + [f"{k}={v}" for k, v in overrides.items()]
    embodied("train", [*args, *ONE_RANK_EACH, f"runner.output_dir={tmp_path}", "runner.val_check_interval=-1",
                       "runner.val_before_train=false", "rollout.pipeline_stage_num=2", "actor.global_batch_size=4",
                       "actor.micro_batch_size=4", f"+env.train.init_params.game_config.log={log}"])
    answers = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((a["row"], a["turn"]) for a in answers) == [(r, t) for r in range(2) for t in (1, 1, 2, 2, 3, 3)]
    slow_first = next(a["at"] for a in answers if a["row"] == 0 and a["turn"] == 1)
    fast_last = max(a["at"] for a in answers if a["row"] != 0)
    assert fast_last < slow_first, answers
