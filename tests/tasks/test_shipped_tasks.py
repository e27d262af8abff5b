"""The shipped tasks: Arithmetic (with the calculator tool) and GuessNumber (feedback over turns)."""

import pytest

from earl_jax.tasks.arithmetic import make_arithmetic
from earl_jax.tasks.guess_number import make_guess_number

FACTORIES = {"arithmetic": make_arithmetic, "guess_number": make_guess_number}


def play_expert(env, seed):
    """The expert's episode: (observations, rewards, last info)."""
    obs, _ = env.reset(seed=seed)
    seen, rewards = [obs], []
    for _ in range(20):
        obs, reward, terminated, truncated, info = env.step(env.expert_answer())
        assert env.observation_space.contains(obs), obs
        seen.append(obs)
        rewards.append(reward)
        if terminated or truncated:
            return seen, rewards, info
    raise AssertionError("the expert's episode did not end")


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("split", ["train", "test"])
def test_expert_succeeds(name, split):
    env = FACTORIES[name](split=split)
    for seed in range(50):
        seen, rewards, info = play_expert(env, seed)
        assert info["success"] is True and info["score"] == 1.0 and sum(rewards) == 1.0
        assert all(o.endswith("\n> ") for o in seen[:-1]) and seen[-1] == ""


def test_arithmetic_expert_calls_the_tool():
    env = make_arithmetic()
    obs, _ = env.reset(seed=3)
    problem = obs.removesuffix("\n> ")
    assert env.expert_answer() == f"[calc {problem}]"
    obs, reward, _, _, info = env.step(env.expert_answer())
    a, b = map(int, problem.split("*"))
    assert (obs, reward, info["tool"]) == (f"= {a * b}\n> ", 0.0, "calc")
    assert env.expert_answer() == str(a * b)
    assert env.step(env.expert_answer())[4]["tool_calls"] == 1


def _problem(env, name, seed):
    obs, _ = env.reset(seed=seed)
    return (obs, env.unwrapped.secret) if name == "guess_number" else obs


@pytest.mark.parametrize("name,kw", [("arithmetic", {}), ("guess_number", {}), ("guess_number", {"offsets": 8})])
def test_splits_disjoint_and_deterministic(name, kw):
    train, test = FACTORIES[name](split="train", **kw), FACTORIES[name](split="test", **kw)
    train_set = {_problem(train, name, s) for s in range(300)}
    test_set = {_problem(test, name, s) for s in range(300)}
    assert train_set and test_set and not train_set & test_set
    assert _problem(train, name, 7) == _problem(FACTORIES[name](split="train", **kw), name, 7)
    with pytest.raises(ValueError):
        FACTORIES[name](split="dev")


def test_arithmetic_rewards():
    env = make_arithmetic()
    env.reset(seed=0)
    assert env.step("12")[1:4] == (0.0, True, False)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("no idea")
    assert (reward, terminated, info["invalid"], info["success"]) == (-1.0, True, True, False)
    env.reset(seed=0)
    right = str(eval(env.unwrapped.problem))  # the test's own check of the product
    _, reward, _, _, info = env.step(f"it is {right}.")
    assert (reward, info["success"], info["invalid"]) == (1.0, True, False)


def test_arithmetic_digits():
    env = make_arithmetic(digits=2)
    obs, _ = env.reset(seed=1)
    a, b = obs.removesuffix("\n> ").split("*")
    assert (len(a), len(b)) == (2, 1)


def test_guess_number_feedback_grows_and_max_turns():
    env = make_guess_number(high=32, max_turns=4)
    obs, _ = env.reset(seed=5)
    assert obs == "guess 0-31\n> " and env.observation_space.contains(obs)
    secret = env.unwrapped.secret
    wrong = 0 if secret != 0 else 1
    context = obs
    obs, reward, terminated, _, info = env.step(str(wrong))
    assert (obs, reward, terminated) == (("higher" if wrong < secret else "lower") + "\n> ", 0.0, False)
    context += str(wrong) + obs
    obs, reward, terminated, _, info = env.step("hmm")
    assert (obs, reward, terminated, info["invalid_answer"]) == ("a number\n> ", -0.1, False, True)
    context += "hmm" + obs
    assert context.count("\n> ") == 3  # one observation a turn
    env.step(str(wrong))
    obs, reward, terminated, truncated, info = env.step(str(wrong))
    assert (obs, reward, terminated, truncated, info["success"], info["score"]) == ("", 0.0, True, False, False, 0.0)


def test_guess_number_off_range_penalty_costs_only_guesses_outside_what_is_left():
    env = make_guess_number(high=32, max_turns=6, show_range=True, off_range_penalty=0.2)
    env.reset(seed=5)
    secret = env.unwrapped.secret
    low, high = (0, secret - 1) if secret > 0 else (1, 31)  # a first wrong guess, inside the range
    first = high if secret > 0 else low
    obs, reward, *_ = env.step(str(first))
    assert reward == 0.0 and obs.endswith(f"{env.unwrapped.low}-{env.unwrapped.top}\n> ")
    outside = first  # the same guess again: the feedback already ruled it out
    _, reward, _, _, info = env.step(str(outside))
    assert reward == -0.2 and not info.get("success")
    _, reward, terminated, _, info = env.step(str(secret))
    assert (reward, terminated, info["score"]) == (1.0, True, 1.0)  # the score is the task's, not the penalty's


def test_guess_number_offsets_range():
    env = make_guess_number(high=16, max_turns=5, offsets=10)
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        lo, top = map(int, obs.removeprefix("guess ").removesuffix("\n> ").split("-"))
        assert top - lo == 15 and lo <= env.unwrapped.secret <= top
        assert play_expert(env, seed)[2]["success"]


def test_guess_number_with_offsets_holds_out_whole_ranges():
    """With shifted ranges the held-out split is by range: a test episode's range never occurs in training, and in
    it any secret can be the answer (by secret, RL learned to skip the held-out secrets)."""
    def ranges(split):
        env = make_guess_number(high=16, offsets=16, split=split)
        seen = {}
        for seed in range(400):
            obs, _ = env.reset(seed=seed)
            seen.setdefault(obs, set()).add(env.unwrapped.secret)
        return seen

    train, test = ranges("train"), ranges("test")
    assert train and test and not set(train) & set(test)
    assert max(len(secrets) for secrets in test.values()) == 16  # every secret of a held-out range occurs


def test_format_answers_are_the_action_space_never_the_expert():
    """--sft.answers format: ShowDigit's SFT episodes answer one uniformly drawn digit (its action_space), the same
    for a seed, independent of the digit shown; the expert's answer is the digit shown."""
    import collections

    from earl_jax.envs.vector.per_game import PerGameVectorEnv
    from earl_jax.models.tokenizer import game_tokenizer, special_ids
    from earl_jax.rl.supervised.warmup import random_legal_games
    from earl_jax.tasks import task_env_factory

    tok = game_tokenizer()
    ids = special_ids(tok)
    make = task_env_factory("earl_jax/ShowDigit-v0", "{}", split="train")

    def episodes(answers: str, n: int = 200):
        env = PerGameVectorEnv([make() for _ in range(n)])
        tokens, mask, _ = random_legal_games(env, tok, list(range(n)), None, eos_id=ids.eos_id, bos_id=ids.bos_id,
                                             max_context=32, max_turns=1, task_answers=answers)
        shown = [tok.decode(row[~m & (row > 0)].tolist()).split()[-2] for row, m in zip(tokens, mask)]
        said = [tok.decode([int(t) for t in row[m] if t != ids.eos_id]) for row, m in zip(tokens, mask)]
        return shown, said

    shown, said = episodes("expert")
    assert said == shown
    shown, said = episodes("format")
    assert all(len(s) == 1 and s.isdigit() for s in said)
    assert len(collections.Counter(said)) == 10 and sum(a == b for a, b in zip(shown, said)) < 50  # ~20 by chance
    assert episodes("format") == (shown, said)  # seeded by the episodes' seeds


def test_show_digit_rewards_and_its_hidden_control():
    from earl_jax.tasks.show_digit import make_show_digit

    env = make_show_digit()
    obs, _ = env.reset(seed=3)
    digit = env.unwrapped.digit
    assert obs == f"d {digit}\n> " and env.expert_answer() == str(digit)
    assert env.step(f"{digit} it is")[1:3] == (1.0, True)
    env.reset(seed=3)
    _, reward, _, _, info = env.step(str((digit + 1) % 10))
    assert (reward, info["success"], info["invalid"]) == (0.0, False, False)
    env.reset(seed=3)
    _, reward, _, _, info = env.step("no")
    assert (reward, info["invalid"]) == (-1.0, True)
    hidden = make_show_digit(hidden=True)
    assert hidden.reset(seed=3)[0] == "d ?\n> " and hidden.unwrapped.digit == digit  # same draw, not shown


def test_arithmetic_balance_lengths_evens_the_train_split_only():
    def lengths(**kw) -> list[int]:
        env = make_arithmetic(**kw)
        return [len(str(eval(env.reset(seed=s)[0].removesuffix("\n> ")))) for s in range(400)]

    natural, balanced = lengths(), lengths(balance_lengths=True)
    assert natural.count(4) < 0.3 * len(natural)  # 3-digit times 2-digit: mostly 5-digit products
    assert 0.4 < balanced.count(4) / len(balanced) < 0.6
    assert lengths(split="test", balance_lengths=True) == lengths(split="test")
    with pytest.raises(ValueError, match="balance_lengths: true or false"):
        make_arithmetic(balance_lengths="false")
