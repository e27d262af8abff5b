"""The format warm-up's data: games of uniformly random legal moves, generated straight from the rules.

Each game is played by the agent loop (`play_games`) with a host policy (rollout/host_policies.py) that reads the
environment's own legal moves (`VectorStep.legal`, or the per-game envs' `info["legal_actions"]`; never by parsing
the prompt text) and answers with the move's text and the end token, as the loop writes a model's answers. No model
and no sampling run, so a warm-up batch costs only the batched game steps. The warm-up teaches the answer format (a
legal move number, then the end token), not the game.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int

from earl_jax.envs.vector import ObservationCodec
from earl_jax.progress import phase
from earl_jax.rollout.agent_loop import PlayConfig, play_games
from earl_jax.rollout.host_policies import HostAnswers, HostPolicy, env_answers, random_legal


def random_legal_games(env: Any, tokenizer: tokenizers.Tokenizer, seeds: Sequence[int], rng: np.random.Generator, *,
                       eos_id: int, bos_id: int | None, max_context: int, max_turns: int = 64,
                       codec: ObservationCodec | None = None,
                       choose: Callable[[Any, np.ndarray, list[list[int]]], np.ndarray] | None = None,
                       task_answers: str = "expert"
                       ) -> tuple[Int[np.ndarray, "n t"], Bool[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
    """One game per row of the vector env `env`: token ids (right-padded with 0), a mask on the answers, and
    each game's length. `choose(env, rows, legal)`: the moves of games `rows` (default: uniform among `legal`;
    experiments/lab/ttt_imitation_check.py passes the solver's). A text task's rows answer with their
    expert's texts (`expert_answer()`, its demonstrations), or with `task_answers="format"` answers drawn from its
    action_space (`format_answer()`: the format, not the answer). An answer that does not fit in `max_context` ends
    its game."""
    per_game = getattr(env, "envs", ())
    if bool(per_game) and all(getattr(e, "is_task", False) for e in per_game):  # a text task: its own answers
        policy = HostPolicy(env_answers(env.envs, "format_answer" if task_answers == "format" else "expert_answer"),
                            tokenizer, eos_id, reads_legal=False)
    else:
        refusal = (f"format warm-up: {type(env).__name__} gives no legal moves to draw from; pass --sft.steps 0 for "
                   "such environments")
        if getattr(env, "num_actions", None) is None:
            raise ValueError(refusal)
        pick = random_legal(rng, refusal) if choose is None else _chooser(env, choose, refusal)
        policy = HostPolicy(pick, tokenizer, eos_id)
    cfg = PlayConfig(max_turn_tokens=max_context, max_turns=max_turns, max_context=max_context, whole_answers=True)
    traj = play_games(policy, env, tokenizer, cfg, None, seeds, bos_id=bos_id, codec=codec)
    return traj.tokens, traj.loss_mask, traj.lengths.astype(np.int64)


def _chooser(env: Any, choose: Callable, refusal: str):
    """random_legal_games' `choose(env, rows, legal lists)` as a host policy's chooser."""
    def pick(games, legal):
        options = [np.flatnonzero(row).tolist() for row in legal]
        if any(not m for m in options):
            raise ValueError(refusal)
        return HostAnswers(moves=np.asarray(choose(env, games, options), np.int64))
    return pick


def format_warmup(policy, state, cfg, env, opponent: str, *, env_factory=None, task_log=None) -> dict[str, float]:
    """The format warm-up, a use of the SFT stage: `--sft.steps` supervised steps on `--sft.games` games (0: the RL
    batch) of uniformly random LEGAL moves (from the rules, no sampling): it teaches the answer format, not the game.
    Updates `state.params` (its optimizer state is dropped after); returns the last step's metrics. `env`: the job's
    training env, played when it holds as many games, else a new one against `opponent` (from `env_factory`, as the
    job's); `task_log`: a text task's training episode log (the demonstrations are dropped from it).

    Every step has the same shape, so its programs compile once: the games (a multiple of the devices), cut to the
    length bucket of the first batch's 95th-percentile game (a cut game loses only late answers; the format is in
    every turn)."""
    import dataclasses

    from earl_jax.envs.vector import make_vector_env
    from earl_jax.rl.algorithm.optim import make_optimizer
    from earl_jax.rl.algorithm.packing import batch_width
    from earl_jax.rl.stages.experience_stage import pad_cols
    from earl_jax.rl.supervised.sft import run_sft

    rng = np.random.default_rng(cfg.run.seed + 12345)
    n_dev = len(policy.planner.devices)
    games = -(-(cfg.sft.games or cfg.batch_size) // n_dev) * n_dev
    env = env if games == env.num_games else make_vector_env(
        dataclasses.replace(cfg.env, opponent=opponent), games, env_factory)

    def batches():
        width = None
        for i in range(cfg.sft.steps):
            # episodes follow --run.seed (a task's expert plays the seed's problems; seed 0 keeps its historic ones)
            seeds = [(10_000_000 + cfg.run.seed * 1_000_003 + i * games + j) % 2**31 for j in range(games)]
            tokens, mask, lengths = random_legal_games(
                env, policy.tokenizer, seeds, rng, eos_id=policy.ids.eos_id, bos_id=policy.ids.bos_id,
                max_context=cfg.rollout.max_context, max_turns=cfg.rollout.max_turns, codec=policy.codec,
                task_answers=cfg.sft.answers)
            if width is None:  # one shape for every step: one compile of each program
                width = batch_width(int(np.percentile(lengths, 95)))
            yield {"tokens": pad_cols(tokens[:, :width], width), "loss_mask": pad_cols(mask[:, :width], width),
                   "lengths": np.minimum(lengths, width)}

    optimizer = make_optimizer(cfg.sft.learning_rate, 5, max(cfg.sft.steps, 6), 0.0, cfg.optim.grad_clip)
    history = run_sft(policy, state, batches(), steps=cfg.sft.steps, optimizer=optimizer)
    if task_log is not None:  # the demonstrations are not RL's episodes: task/* counts only what the policy played
        task_log.drain("sft")
    return history[-1] if history else {}


def start_of_run(trainer, control) -> dict[str, Any]:
    """Step 0 of a run (`Trainer.run`): the format warm-up (free-text moves: constrained moves have no format to
    learn), whose weights become the KL term's reference, then the first evaluation, logged as step 0. Returns the
    evaluation's metrics (carried into the records until the next one)."""
    cfg, warm = trainer.cfg, {}
    if cfg.sft.steps and not cfg.rollout.constrain_moves:
        shown = "format answers" if cfg.sft.answers == "format" else "expert demonstrations"
        what = f"the task's {shown}" if trainer.task else "random legal games"
        control.beat(f"format warm-up ({what})")
        with phase(f"format warm-up: {cfg.sft.steps} supervised steps on {what}"):
            warm = {f"warmup/{k}": v for k, v in trainer.format_warmup().items()}
        warm.update(trainer.policy.planner.stage_log_dict("sft"))
        if trainer.state.ref_params is not None:  # the KL term holds RL near where RL starts: after the warm-up
            trainer.state.rebase_reference()
    last_eval = trainer.evaluate.logged(trainer.step, control.bar.status)
    trainer.logger.log({"step": 0, **warm, **last_eval, "eval/fresh": True})
    return last_eval
