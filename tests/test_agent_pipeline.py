"""Agent episodes through the whole pipeline (Ray, env / rollout / actor workers, FSDP2 over two
gloo ranks): skyrl-gym's gsm8k_multi_turn, unchanged, on a parquet dataset in SkyRL's layout,
trains a few GRPO steps with finite metrics, and the episodes the eval logged keep their ids
token by token: the chat template's prompt, each response verbatim, each observation templated."""

from __future__ import annotations

import json
import math
import string

import pytest

from tests.runs import embodied
from tests.test_agent_env import CHATML

pytestmark = pytest.mark.slow
QUESTIONS = [("Tom has 3 apples and buys 4. How many?", "7"), ("What is 2+2?", "4"), ("Half of 10?", "5"),
             ("Ann had 9 pens and lost 2. How many?", "7")]
FOLLOW_UP = ("Please provide your step-by-step reasoning, and also include a tentative numeric answer at the "
             "end in the exact format: '#### ANSWER'.")


@pytest.fixture(scope="module")
def skyrl_run(tmp_path_factory, ray_session):
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
    args = [f"actor.model.model_path={root / 'model'}", f"data.train_data_paths=[{root / 'train.parquet'}]",
            f"data.val_data_paths=[{root / 'val.jsonl'}]", f"runner.output_dir={root / 'out'}",
            "env.train.init_params.game=gsm8k_multi_turn", "env.eval.init_params.game=gsm8k_multi_turn",
            "env.train.init_params.tools=[]", "env.eval.init_params.tools=[]",
            "env.train.max_episode_steps=2", "env.eval.max_episode_steps=2", "runner.max_epochs=2",
            "runner.val_check_interval=2", "data.rollout_batch_size=2", "algorithm.group_size=4",
            "data.val_rollout_batch_size=4", "data.max_prompt_length=320", "runner.seq_length=352",
            "actor.micro_batch_size=8", "actor.global_batch_size=16"]
    result, _ = embodied("train", ["--config-name", "agent_arithmetic_tools_tiny", *args])
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
    eos, width = tok.eos_token_id, 352 - 320
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
            assert kind == 1 and (response[-1] == eos or len(response) == width)
            assert eos not in response[:-1]  # the response ends at its first EOS
            if after[1]:  # the separator after an EOS, then the game's next message, templated
                text = "\n" * (response[-1] == eos) + f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
                assert after[1] == tok(text, add_special_tokens=False)["input_ids"]
