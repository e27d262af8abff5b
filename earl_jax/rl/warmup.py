"""The format warm-up's data: games of uniformly random legal moves, generated straight from the rules.

Each game is played by reading the environment's own legal moves (`VectorStep.legal`, or the per-game
envs' `info["legal_actions"]`; never by parsing the prompt text) and answering with the move's text and
the end token, exactly as the agent loop tokenizes a policy's answers. No model and no sampling loop run,
so a warm-up batch costs only the batched game steps. The warm-up teaches the answer format (a legal move
number, then the end token), not the game.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tokenizers
from jaxtyping import Bool, Int

from earl_jax.envs.vector import ObservationCodec
from earl_jax.progress import phase
from earl_jax.rollout.agent_loop import _Episodes


def _legal_moves(step) -> list[list[int]]:
    if step.legal is not None:
        return [np.flatnonzero(row).tolist() for row in step.legal]
    return [info.get("legal_actions") or [] for info in step.infos()]


def random_legal_games(env: Any, tokenizer: tokenizers.Tokenizer, seeds: Sequence[int], rng: np.random.Generator, *,
                       eos_id: int, bos_id: int | None, max_context: int, max_turns: int = 64,
                       codec: ObservationCodec | None = None,
                       choose: Callable[[Any, np.ndarray, list[list[int]]], np.ndarray] | None = None,
                       task_answers: str = "expert"
                       ) -> tuple[Int[np.ndarray, "n t"], Bool[np.ndarray, "n t"], Int[np.ndarray, " n"]]:
    """One game per row of the vector env `env`: token ids (right-padded with 0), a mask on the answers, and
    each game's length. `choose(env, rows, legal)`: the moves of games `rows` (default: uniform among `legal`;
    experiments/benchmarks/ttt_imitation_check.py passes the solver's). A text task's rows answer with their
    expert's texts (`expert_answer()`, its demonstrations), or with `task_answers="format"` answers drawn from its
    action_space (`format_answer()`: the format, not the answer)."""
    codec = codec or ObservationCodec(tokenizer)
    per_game = getattr(env, "envs", ())
    expert = bool(per_game) and all(getattr(e, "is_task", False) for e in per_game)
    n = len(seeds)
    ep = _Episodes(n, max_turns)
    step = env.reset(list(map(int, seeds)))
    ids, counts = codec.encode_padded(step.obs)
    if bos_id is not None:
        ids, counts = np.concatenate([np.full((n, 1), bos_id, np.int32), ids], 1), counts + 1
    ep.append(np.arange(n), ids, counts, False)
    live = ~(step.terminated | step.truncated)
    for _ in range(max_turns):
        rows = np.flatnonzero(live)
        if not len(rows):
            break
        if expert:  # a text task: its expert's answers (the demonstrations of its SFT stage)
            answer = "format_answer" if task_answers == "format" else "expert_answer"
            texts = [getattr(env.envs[i], answer)() for i in rows.tolist()]
            moves = np.zeros(len(rows), np.int64)
        else:
            legal = _legal_moves(step) if len(step.rows) == len(rows) else None
            if legal is None or any(not m for m in legal):
                raise ValueError(f"format warm-up: {type(env).__name__} gives no legal moves to draw from; pass "
                                 "--sft.steps 0 for such environments")
            moves = (np.array([m[int(rng.integers(len(m)))] for m in legal], np.int64) if choose is None
                     else np.asarray(choose(env, rows, legal), np.int64))
            texts = [str(m) for m in moves.tolist()]
        answers = [e.ids + [eos_id] for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        width = max(map(len, answers))
        fits = ep.length[rows] + np.array([len(a) for a in answers]) <= max_context
        live[rows[~fits]] = False
        rows, answers, moves, texts = rows[fits], [a for a, f in zip(answers, fits) if f], moves[fits], \
            [t for t, f in zip(texts, fits) if f]
        if not len(rows):
            break
        padded = np.array([a + [0] * (width - len(a)) for a in answers], np.int32)
        ep.append(rows, padded, [len(a) for a in answers], True)
        step = env.step(rows, moves=moves) if getattr(env, "accepts_moves", False) and not expert else \
            env.step(rows, texts)
        going = ~(step.terminated | step.truncated)
        live[rows[~going]] = False
        step = _subset(step, going)
        ids, counts = codec.encode_padded(step.obs) if going.any() else (np.zeros((0, 0), np.int32), np.zeros(0))
        room = ep.length[rows[going]] + counts + 1 <= max_context  # room for another answer
        live[rows[going][~room]] = False
        ep.append(rows[going][room], ids[room], counts[room], False)
        step = _subset(step, room)
    a = ep.arrays()
    return a["tokens"], a["mask"], ep.length.copy()


def _subset(step, keep: np.ndarray):
    """The entries of a VectorStep where `keep` is True (what the next turn reads: obs, legal moves)."""
    import dataclasses

    infos = step._infos
    return dataclasses.replace(
        step, rows=step.rows[keep], _obs=[o for o, k in zip(step.obs, keep.tolist()) if k], _obs_bytes=None,
        legal=None if step.legal is None else step.legal[keep],
        _infos=None if infos is None else [i for i, k in zip(infos, keep.tolist()) if k])


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
    from earl_jax.rl.experience import pad_cols
    from earl_jax.rl.optim import make_optimizer
    from earl_jax.rl.packing import batch_width
    from earl_jax.rl.sft import run_sft

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


def start_of_run(trainer, session) -> dict[str, Any]:
    """Step 0 of a run (`Trainer.run`): the format warm-up (free-text moves: constrained moves have no format to
    learn), then the first evaluation, logged as step 0. Returns the evaluation's metrics (carried into the records
    until the next one)."""
    cfg, warm = trainer.cfg, {}
    if cfg.sft.steps and not cfg.rollout.constrain_moves:
        shown = "format answers" if cfg.sft.answers == "format" else "expert demonstrations"
        what = f"the task's {shown}" if trainer.task else "random legal games"
        session.beat(f"format warm-up ({what})")
        with phase(f"format warm-up: {cfg.sft.steps} supervised steps on {what}"):
            warm = {f"warmup/{k}": v for k, v in trainer.format_warmup().items()}
        warm.update(trainer.policy.planner.stage_log_dict("sft"))
    last_eval = trainer.evaluate.logged(trainer.step, session.bar.status)
    trainer.logger.log({"step": 0, **warm, **last_eval, "eval/fresh": True})
    return last_eval
