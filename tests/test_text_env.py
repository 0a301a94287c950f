"""The arithmetic prompt set, math-verify scoring (off the main thread, with a deadline) and the
single-step text env on real files and a real tokenizer."""

import gzip
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from envs.arithmetic import make_problems
from envs.text import DataError, TextEnv, load_prompts, load_tokenizer, read_records
from envs.protocol import NO_TOKEN
from envs.vector_env import EnvSetupError
from envs.verifier import CHUNK, CORRECT, TIMEOUT, UNPARSABLE, WRONG, Verifier, score_one
from envs.arithmetic import read_jsonl


def test_split_is_disjoint_and_every_answer_verifies(tiny_math):
    train, test = read_jsonl(tiny_math["data"] / "train.jsonl"), read_jsonl(tiny_math["data"] / "test.jsonl")
    assert (len(train), len(test)) == (1800, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    verdicts = Verifier().score([r["answer"] for r in test], [r["answer"] for r in test])
    assert verdicts.correct == [True] * 200
    assert make_problems(5, seed=3) == make_problems(5, seed=3) != make_problems(5, seed=4)


def test_warm_start_lands_between_5_and_50_percent(tiny_math):
    assert 0.05 <= tiny_math["accuracy"] <= 0.5
    assert (tiny_math["model"] / "config.json").is_file() and (tiny_math["model"] / "tokenizer.json").is_file()


@pytest.mark.parametrize("response, answer, status", [
    ("47", "47", CORRECT), (" 47", "47", CORRECT), ("\\boxed{47}", "47", CORRECT), ("-5", "-5", CORRECT),
    ("48", "47", WRONG), ("5", "-5", WRONG), ("", "47", UNPARSABLE), ("abc", "47", UNPARSABLE),
    # math-verify evaluates expressions: copying the question must not count as its answer
    ("12+35", "47", WRONG), ("3-8", "-5", WRONG), ("\\boxed{40+7}", "47", WRONG), ("2*3", "6", WRONG),
    ("\\frac{1}{2}", "\\frac{1}{2}", CORRECT), ("0.5", "\\frac{1}{2}", CORRECT),
])
def test_what_counts_as_the_answer(response, answer, status):
    assert score_one(response, answer) == status


def test_copying_every_question_scores_nothing(tiny_math):
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    copies = Verifier().score([r["prompt"].rstrip("=") for r in rows], [r["answer"] for r in rows])
    assert sum(copies.correct) == 0


def test_scoring_works_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread
    verifier, out = Verifier(), {}
    thread = threading.Thread(target=lambda: out.update(v=verifier.score(["47", "46"], ["47", "47"])))
    thread.start()
    thread.join()
    assert out["v"].status == [CORRECT, WRONG]
    verifier.close()


def test_a_batch_scores_as_each_response_alone():
    # distinct pairs are scored once, in tasks of CHUNK pairs: every response still gets its own verdict
    responses = [str(n) for n in range(3 * CHUNK)] * 3 + ["", "12+35", "\\boxed{47}"]
    references = [str(n % 50) for n in range(3 * CHUNK)] * 3 + ["47"] * 3
    verifier = Verifier()
    verdicts = verifier.score(responses, references)
    verifier.close()
    assert verdicts.status == [score_one(r, a) for r, a in zip(responses, references)]
    assert verdicts.count(CORRECT) == 3 * min(3 * CHUNK, 50) + 1 and verdicts.count(UNPARSABLE) == 1


def test_a_response_past_the_deadline_scores_zero_and_is_counted():
    # sympy evaluates 9^(9^(9^9)) exactly (hundreds of millions of digits: minutes, beyond the
    # reach of math-verify's own alarm); the batch deadline cuts it and the pool is replaced
    verifier = Verifier(timeout_s=60, deadline_s=0.5)
    tower = "9^{9^{9^{9}}}"
    verdicts = verifier.score([f"\\boxed{{{tower}}}"], [tower])
    assert verdicts.status == [TIMEOUT] and verdicts.count(TIMEOUT) == 1
    assert verifier.score(["1"], ["1"]).status == [CORRECT]  # a fresh pool carries on
    verifier.close()


def _env_cfg(tiny_math, **over):
    params = dict(data_paths=[str(tiny_math["data"] / "test.jsonl")], shuffle=False, prompt_key="prompt",
                  answer_key="answer", apply_chat_template=True, max_prompt_length=8, reward_scale=2.0,
                  tokenizer_model=None, model_path=str(tiny_math["model"]), use_fast=True, trust_remote_code=False,
                  pass_at_group=False)
    params.update(over.pop("init_params", {}))
    cfg = dict(env_type="text", total_num_envs=8, auto_reset=False, ignore_terminations=False,
               use_fixed_reset_state_ids=True, group_size=4, max_episode_steps=1, use_rel_reward=False,
               reward_coef=1.0, seed=0, each_reset_state_once=False, video_cfg={"save_video": False}, init_params=params)
    cfg.update(over)
    return cfg


def _tokens(env, texts):
    ids = [env.tokenizer(t)["input_ids"] + [env.eos] for t in texts]
    out = np.full((len(texts), 1, 6), env.pad)
    for i, seq in enumerate(ids):
        out[i, 0, :len(seq)] = seq
    return out


def test_groups_share_a_prompt_and_rewards_follow_the_reference_scale(tiny_math):
    env = TextEnv(_env_cfg(tiny_math), num_envs=8)
    obs = env.reset()
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    assert obs["prompts"] == [rows[0]["prompt"]] * 4 + [rows[1]["prompt"]] * 4
    assert obs["input_ids"].shape == (8, 8) and obs["attention_mask"][:, 0].sum() == 0  # left padding
    answers = [rows[0]["answer"], "999", "", rows[0]["prompt"].rstrip("=")] + [rows[1]["answer"]] * 4
    _, rewards, terminations, truncations, infos = env.chunk_step(_tokens(env, answers))
    assert rewards[:, 0].tolist() == [2.0, -2.0, -2.0, -2.0, 2.0, 2.0, 2.0, 2.0]
    assert terminations.all() and not truncations.any()
    assert infos["success"].tolist() == [True, False, False, False, True, True, True, True]
    assert infos["task_descriptions"] == ["test"] * 8  # per data file
    assert env.pop_metrics() == {"unparsable": 1.0, "verifier_timeout": 0.0, "prompts_filtered": 0.0}
    samples = env.pop_samples()
    assert samples[0] == {"prompt": rows[0]["prompt"], "response": rows[0]["answer"], "answer": rows[0]["answer"],
                          "reward": 2.0}


def test_pass_at_group_counts_a_prompt_solved_when_any_of_its_group_is(tiny_math):
    env = TextEnv(_env_cfg(tiny_math, init_params={"pass_at_group": True}), num_envs=8)
    env.reset()
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    answers = ["999", rows[0]["answer"], "", "999"] + ["999"] * 4  # prompt 0: 1 of 4 right, prompt 1: none
    _, rewards, _, _, infos = env.chunk_step(_tokens(env, answers))
    assert infos["success_once"].tolist() == [True] * 4 + [False] * 4  # pass@4 per episode of the group
    assert infos["success"].tolist() == [False, True] + [False] * 6  # each response's own verdict
    assert rewards[:, 0].tolist() == [-2.0, 2.0] + [-2.0] * 6
    with pytest.raises(Exception, match="pass_at_group needs groups"):
        TextEnv(_env_cfg(tiny_math, group_size=1, init_params={"pass_at_group": True}), num_envs=8)


def test_text_env_scores_off_the_main_thread(tiny_math):
    env = TextEnv(_env_cfg(tiny_math), num_envs=8)
    env.reset()
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    out = {}
    thread = threading.Thread(target=lambda: out.update(step=env.chunk_step(
        _tokens(env, [rows[0]["answer"]] * 4 + [rows[1]["answer"]] * 4))))
    thread.start()
    thread.join()
    assert out["step"][1][:, 0].tolist() == [2.0] * 8


def test_each_prompt_once_per_epoch_in_a_seeded_shuffle(tiny_math):
    def walk(seed, epochs=2):
        envs = [TextEnv(_env_cfg(tiny_math, total_num_envs=16, seed=seed, init_params={"shuffle": True}),
                        num_envs=8, seed_offset=offset) for offset in (0, 8)]  # two workers
        seen = []
        for _ in range(epochs * 200 // 4):
            for env in envs:
                seen += env.reset()["prompts"][::4]
        return seen

    seen = walk(seed=1)
    assert sorted(seen[:200]) == sorted(seen[200:]) == sorted(r["prompt"] for r in read_jsonl(tiny_math["data"] / "test.jsonl"))
    assert seen[:200] != seen[200:]  # a new order each epoch
    assert walk(seed=1, epochs=1) == seen[:200] and walk(seed=2, epochs=1) != seen[:200]


def test_prompts_over_the_length_limit_are_dropped_and_counted(tmp_path, tiny_math):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"q": p, "a": "1"}) + "\n" for p in ["1+0=", "1000000+0=", "0+1="]))
    env = TextEnv(_env_cfg(tiny_math, init_params={"data_paths": [str(path)], "prompt_key": "q", "answer_key": "a"}),
                  num_envs=8)
    assert [p.text for p in env.prompts] == ["1+0=", "0+1="] and env.filtered == 1


def test_parquet_and_a_chat_template(tmp_path, tiny_math):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+2=", "3+4="], "answer": [3, 7]}), tmp_path / "set.parquet")
    tokenizer = load_tokenizer({"model_path": str(tiny_math["model"])})
    assert read_records(tmp_path / "set.parquet", "prompt", "answer") == [("1+2=", "3"), ("3+4=", "7")]
    tokenizer.chat_template = "{% for m in messages %}={{ m['content'] }}{% endfor %}"
    prompts, _ = load_prompts({"data_paths": [str(tmp_path / "set.parquet")], "prompt_key": "prompt",
                               "answer_key": "answer", "max_prompt_length": 8, "apply_chat_template": True}, tokenizer)
    assert [p.text for p in prompts] == ["=1+2=", "=3+4="]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n', r"bad.jsonl:2: not JSON \(Expecting"),
    ('{"prompt": "1+1=", "answer": "2"}\n["2+2=", "4"]\n', r"bad.jsonl:2: not a JSON object"),
    ('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n', r"bad.jsonl:2: no key 'prompt' \(data.prompt_key\)"),
    ('{"prompt": "1+1="}\n', r"bad.jsonl:1: no key 'answer' \(data.answer_key\)"),
    ("", r"bad.jsonl holds no records"),
    ('{"prompt": "1000000000+1=", "answer": "1"}\n', r"all 1 prompts .* longer than data.max_prompt_length=8"),
])
def test_bad_data_is_one_message_naming_file_line_and_key(tmp_path, tiny_math, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    tokenizer = load_tokenizer({"model_path": str(tiny_math["model"])})
    with pytest.raises(DataError, match=message):
        load_prompts({"data_paths": [str(path)], "prompt_key": "prompt", "answer_key": "answer",
                      "max_prompt_length": 8, "apply_chat_template": True}, tokenizer)


def _parquet(path: Path, groups: int = 4) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="] * 40, "answer": ["2"] * 40}), path, row_group_size=40 // groups,
                   compression="none")
    return path.read_bytes()


def _corrupt_row_group(path: Path, group: int) -> bytes:
    import pyarrow.parquet as pq

    data = bytearray(_parquet(path))
    start = pq.ParquetFile(path).metadata.row_group(group).column(0).data_page_offset
    data[start:start + 40] = bytes(b ^ 0xFF for b in data[start:start + 40])
    return bytes(data)


@pytest.mark.parametrize("name, content, message", [
    ("latin1.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "café", "answer": "4"}\n'.encode("latin-1"),
     r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"),
    ("utf16.jsonl", '{"prompt": "1+1=", "answer": "2"}\n'.encode("utf-16"), r"utf16.jsonl:1: not UTF-8 text"),
    ("gzipped.jsonl", gzip.compress(b'{"prompt": "1+1=", "answer": "2"}\n', mtime=0),  # mtime 0: every test process collects the same id
     r"gzipped.jsonl:1: not UTF-8 text"),
    ("text.parquet", b'{"prompt": "1+1=", "answer": "2"}\n', r"text.parquet: not a readable parquet file \(Parquet magic"),
    ("cut.parquet", lambda path: _parquet(path)[:300], r"cut.parquet: not a readable parquet file"),
    ("group.parquet", lambda path: _corrupt_row_group(path, 2), r"group.parquet: row group 3 of 4 cannot be read"),
])
def test_a_malformed_data_file_is_one_message_naming_file_and_line_or_row_group(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content(path) if callable(content) else content)
    with pytest.raises(DataError, match=message) as err:
        read_records(path, "prompt", "answer")
    assert "\n" not in str(err.value)


def test_a_byte_order_mark_is_read_as_utf8(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes('{"prompt": "1+1=", "answer": "2"}\n'.encode("utf-8-sig"))
    assert read_records(path, "prompt", "answer") == [("1+1=", "2")]


@pytest.mark.parametrize("key, value", [("each_reset_state_once", True), ("num_processes", 2),
                                        ("task_suite_name", "libero_10"), ("reset_state_order", "random")])
def test_env_keys_the_text_env_cannot_honour_are_refused(tiny_math, key, value):
    from envs.text import check_config

    with pytest.raises(EnvSetupError, match=f"^{key}: not supported by the text env, because"):
        check_config(_env_cfg(tiny_math, **{key: value}))  # what validate runs before workers start
    with pytest.raises(EnvSetupError, match=f"^env.\\*.{key}: not supported by the text env"):
        TextEnv(_env_cfg(tiny_math, **{key: value}), num_envs=8)


def test_responses_end_at_the_configured_eos(tiny_math):
    """rollout.eos reaches the env (init_params.eos_token_id): a response ends where the policy
    stops, not at the tokenizer's EOS."""
    env = TextEnv(_env_cfg(tiny_math), num_envs=8)
    stop = env.tokenizer("+")["input_ids"][-1]
    custom = TextEnv(_env_cfg(tiny_math, init_params={"eos_token_id": stop}), num_envs=8)
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    tokens = np.full((8, 1, 12), env.pad)
    for i, row in enumerate([rows[0]] * 4 + [rows[1]] * 4):
        seq = env.tokenizer(row["answer"])["input_ids"] + [stop] + env.tokenizer("7")["input_ids"] + [env.eos]
        tokens[i, 0, :len(seq)] = seq
    for e in (env, custom):
        e.reset()
    assert env.chunk_step(tokens)[1][:, 0].tolist() == [-2.0] * 8  # '<answer>+7' is not the answer
    assert custom.eos == stop and custom.chunk_step(tokens)[1][:, 0].tolist() == [2.0] * 8


def test_a_response_that_ended_at_a_stop_string_is_scored_up_to_it(tiny_math):
    """Past a stop string the rollout sends ``NO_TOKEN``, not padding: the env scores the tokens
    before it (no EOS to cut at) and counts them as the response's length."""
    env = TextEnv(_env_cfg(tiny_math), num_envs=8)
    env.reset()
    rows = read_jsonl(tiny_math["data"] / "test.jsonl")
    tokens = np.full((8, 1, 6), NO_TOKEN)
    answers = [env.tokenizer(row["answer"])["input_ids"] for row in [rows[0]] * 4 + [rows[1]] * 4]
    for i, seq in enumerate(answers):
        tokens[i, 0, :len(seq)] = seq
    assert env.responses(tokens)[1].tolist() == [len(seq) for seq in answers]
    assert env.chunk_step(tokens)[1][:, 0].tolist() == [2.0] * 8


def test_apply_chat_template_false_keeps_the_prompt_text_as_it_is(tiny_math, tmp_path):
    """RLinf's data.apply_chat_template: with a tokenizer that has a template, false tokenizes the
    prompt itself (with the tokenizer's special tokens), true the templated conversation."""
    from transformers import AutoTokenizer

    folder = tmp_path / "templated"
    tokenizer = AutoTokenizer.from_pretrained(tiny_math["model"])
    tokenizer.chat_template = "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    tokenizer.save_pretrained(folder)
    params = {"data_paths": [str(tiny_math["data"] / "test.jsonl")], "prompt_key": "prompt", "answer_key": "answer",
              "max_prompt_length": 16}
    plain, _ = load_prompts(params | {"apply_chat_template": False}, tokenizer)
    templated, _ = load_prompts(params | {"apply_chat_template": True}, tokenizer)
    first = read_records(tiny_math["data"] / "test.jsonl", "prompt", "answer")[0][0]
    assert plain[0].text == first and plain[0].ids == tokenizer(first)["input_ids"]
    assert templated[0].text == f"Q:{first}A:" and len(templated[0].ids) == len(plain[0].ids) + 4
