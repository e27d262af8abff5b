"""Chat templates (earl_jax/tasks/chat.py): a checkpoint whose tokenizer_config.json has one renders a task's turns
through it, each turn the new suffix of the render, token for token; a template that is not prefix-stable is refused.

The fixture is written here: a Qwen-like ChatML template over a character tokenizer whose special tokens are
Qwen's (`<|im_end|>` is the stop token, no BOS), random tiny weights, a Hugging Face folder.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from earl_jax.cli import ConfigError
from earl_jax.models.loader import save_pretrained
from earl_jax.models.model_config import get_config
from earl_jax.models.qwen2 import Qwen2
from earl_jax.rl.job.validate import check_job
from earl_jax.rl.loop.trainer import Trainer
from earl_jax.tasks.chat import ChatTemplate, ChatTemplateError, read_chat_template
from earl_jax.tasks.guess_number import GuessNumber
from earl_jax.tasks.tools import CHARSET
from exact_cases import BASE, _rollout_and_experience, _runs
from jobs import job, with_fields

END = "<|im_end|>"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TURN_COUNTER = CHATML.replace("You are a helpful assistant.", "Turn ' + ((messages|length + 1) // 2)|string + '")
TRIMMED = CHATML.replace("message.content +", "message.content|trim +")  # prefix-stable until an answer has spaces


def _user(obs: str) -> str:
    return f"<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"


def test_turns_are_the_suffixes_the_render_adds():
    chat = ChatTemplate(CHATML, END)
    conv = chat.conversation()
    first = conv.start("guess 0-31\n> ")
    assert first == SYSTEM + _user("guess 0-31\n> ")
    assert conv.turn("16", True, "higher\n> ") == "\n" + _user("higher\n> ")  # the sampled stop wrote <|im_end|>
    assert conv.turn("24 ", False, "lower\n> ") == END + "\n" + _user("lower\n> ")  # cut: the env closes the turn
    messages = [{"role": "user", "content": "guess 0-31\n> "}, {"role": "assistant", "content": "16"},
                {"role": "user", "content": "higher\n> "}, {"role": "assistant", "content": "24 "},
                {"role": "user", "content": "lower\n> "}]
    assert conv.text == chat.render(messages)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(ChatTemplateError, match="not prefix-stable: rendering turn 2 rewrote"):
        ChatTemplate(TURN_COUNTER, END)
    with pytest.raises(ChatTemplateError, match="does not end with the model's stop token '</s>'"):
        ChatTemplate(CHATML, "</s>")
    conv = ChatTemplate(TRIMMED, END).conversation()  # passes the probe; the answer it trims is refused
    conv.start("guess 0-31\n> ")
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        conv.turn("16 ", True, "higher\n> ")


def _tokenizer() -> Tokenizer:
    """One token per character, Qwen's special tokens (pad <|endoftext|>, stop <|im_end|>, no BOS)."""
    specials = ["<|endoftext|>", "<|im_start|>", END]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(CHARSET) + ["<unk>"])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials + ["<unk>"])
    return tok


def _checkpoint(folder, template: str | None):
    tok = _tokenizer()
    cfg = get_config("tiny", vocab_size=tok.get_vocab_size())
    save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32), folder, tok)
    config = {"eos_token": END, "pad_token": "<|endoftext|>", "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def chatml(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("chatml"), CHATML)


def _job(tmp_path, checkpoint, **fields):
    return with_fields(job(), **{**BASE, "env__task": "earl_jax/GuessNumber-v0", "rollout__max_turn_tokens": 6,
                                 "rollout__max_context": 512, "model__hf_checkpoint": str(checkpoint),
                                 "run__run_dir": str(tmp_path), **fields})


def test_a_checkpoint_template_renders_every_turn_of_a_rollout(tmp_path, chatml):
    """Every episode is, token for token and mask bit for mask bit, the ChatML text built by hand around the sampled
    answers: observations replayed from the task as user turns, `<|im_end|>` from the env after a cut answer."""
    assert read_chat_template(chatml) == (CHATML, {"eos_token": END, "pad_token": "<|endoftext|>"})
    cfg = _job(tmp_path, chatml)
    check_job(cfg)
    trainer = Trainer(cfg, log=False)
    tok = trainer.policy.tokenizer
    end = tok.token_to_id(END)
    assert trainer.policy.ids.eos_id == end and trainer.policy.ids.bos_id is None
    traj, _, trained, _ = _rollout_and_experience(trainer)
    np.testing.assert_array_equal(trained, traj.tokens)
    seeds, _, _ = trainer.rollout_inputs()
    enc = lambda text: tok.encode(text).ids  # noqa: E731
    stops = cuts = 0
    for row in range(traj.num_games):
        n = int(traj.lengths[row])
        ids, mask = traj.tokens[row, :n], traj.loss_mask[row, :n]
        game = GuessNumber(split="train")
        obs, _ = game.reset(seed=int(seeds[row]))
        chunk, expected, expected_mask = SYSTEM + _user(obs), [], []
        for start, stop, model in _runs(mask):
            piece = ids[start:stop].tolist() if model else enc(chunk)
            expected += piece
            expected_mask += [model] * len(piece)
            if model:
                stopped = piece[-1] == end
                stops, cuts = stops + stopped, cuts + (not stopped)
                obs = game.step(tok.decode(piece, skip_special_tokens=True))[0]
                chunk = ("" if stopped else END) + "\n" + _user(obs)
        np.testing.assert_array_equal(ids, expected, err_msg=f"row {row}: tokens")
        np.testing.assert_array_equal(mask, expected_mask, err_msg=f"row {row}: loss mask")
    assert stops > 0 and cuts > 0 and traj.num_turns.max() >= 2  # answers of both ends, later turns
    print(f"ChatML rollout: {stops} answers stopped on {END}, {cuts} cut at the budget")


def test_off_renders_plain_text_and_refusals_come_at_the_start(tmp_path, chatml):
    trainer = Trainer(_job(tmp_path / "off", chatml, env__chat_template="off"), log=False)
    env = trainer.matchmaker.train_env(0)
    assert env.reset([3], rows=[0]).obs == [GuessNumber(split="train").reset(seed=3)[0]]  # no template around it
    bad = _checkpoint(tmp_path / "counter", TURN_COUNTER)
    with pytest.raises(ConfigError, match="--env.chat-template auto: chat template: not prefix-stable"):
        check_job(_job(tmp_path, bad))
    check_job(_job(tmp_path, bad, env__chat_template="off"))
    plain = _checkpoint(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match="--env.chat-template on: .* has no chat_template"):
        check_job(_job(tmp_path, plain, env__chat_template="on"))
    with pytest.raises(ConfigError, match="--env.chat-template on: chat templates render a text task's turns"):
        check_job(with_fields(job(), env__chat_template="on"))
