"""Batched text environments: every game of a rollout batch stepped by one call.

The agent loop used to step one `OpenSpielTextEnv` per game after each decoded turn, and that host
work was 55-60% of a 512-game rollout on an H100. Here Connect Four and Tic-Tac-Toe are array code
over a batch (uint64 bitboards, winning lines as tables), with batched opponents, a batched parser
and a table-driven tokenizer path, observationally identical to the per-game envs (tests replay
thousands of games through both, OpenSpiel being the reference).

    connect_four.py   rules and a vectorized full-width negamax (== connect_four_search.best_moves)
    tic_tac_toe.py    rules and a perfect-play table over all reachable positions (== SolverOpponent)
    opponents.py      random / alphabeta:D / solver for a batch, per-game seeded RNG streams
    render.py         board text and observation strings for a batch
    parser.py         parse_actions: parser.parse_action for a batch
    codec.py          ObservationCodec: observations -> token ids, answer ids -> moves
    env.py            VectorTextEnv
    per_game.py       PerGameVectorEnv (any OpenSpiel game, mcts, user envs) and make_vector_env
    step.py           VectorStep, what reset and step return

The agent loop, per rollout:

    env = make_vector_env(env_config, n)                 # VectorTextEnv or the per-game wrapper
    codec = ObservationCodec(tokenizer)
    first = env.reset(seeds)                             # VectorStep over all n games
    tokens = codec.encode(first.obs)                     # list[list[int]], == tokenizer.encode(o).ids
    while env.live.any():
        rows = np.flatnonzero(env.live)
        answer_ids = [generated[i][0] for i in rows]     # the decoded turn
        if env.accepts_moves:
            step = env.step(rows, moves=codec.answers_to_moves(answer_ids))
        else:                                            # user envs read their own text
            step = env.step(rows, codec.decode(answer_ids))
        step.reward, step.terminated, step.truncated, step.winners, step.invalid  # arrays over rows
        tokens = codec.encode(step.obs)                  # only the games in rows

Alpha-beta speed (Connect Four, 512 mid-game positions, one call; see experiments/bench_envs.py
and experiments/results/bench_envs.json for the measured numbers on this machine): the search is
full width, so its cost grows about 7x per ply: depth 1 and 2 stay in the low milliseconds,
depth 3 costs tens of milliseconds and depth 4 a few hundred, still several times faster than
the per-game alpha-beta for the same 512 positions.
"""
from earl_jax.envs.vector.codec import ObservationCodec
from earl_jax.envs.vector.env import VectorTextEnv
from earl_jax.envs.vector.parser import parse_actions
from earl_jax.envs.vector.per_game import PerGameVectorEnv, make_vector_env
from earl_jax.envs.vector.step import NO_WINNER, VectorStep

__all__ = ["NO_WINNER", "ObservationCodec", "PerGameVectorEnv", "VectorStep", "VectorTextEnv", "make_vector_env",
           "parse_actions"]
