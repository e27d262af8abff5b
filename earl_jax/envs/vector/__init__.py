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

Measured (experiments/bench_envs.py -> experiments/results/bench_envs.json; a shared 2-core x86 VM
at load ~8, so wall times are inflated; random agent vs random opponent, compact style, median
host time of one lock-step turn: parse the answer ids + step + encode the observations):

    games   per-game path (decode, OpenSpielTextEnv.step, tokenizer.encode)   vector
      64      5.8 ms (Connect Four)  2.4 ms (Tic-Tac-Toe)                   0.39 / 0.40 ms
     512     38 ms                  32 ms                                   1.4 / 1.3 ms
    2048    117 ms                 108 ms                                   5.9 / 6.6 ms (2.9 / 3.8 ms CPU)

At 512 games, about 0.07 ms of a turn is reading answers (cached), 0.6 ms the env step (a third of
it gluing observation strings, a quarter the opponent) and 0.3 ms the token ids (a Python list
per game; `ObservationCodec.encode_padded` gives arrays for less). Resets: 9 ms for 512 games with
64 distinct seeds (a GRPO batch), ~40 ms with 512 (gymnasium's Generator per new seed, ~20 us, is
most of it; cached per seed).

Alpha-beta (Connect Four, 512 mid-game positions in one call): the batched search is full width
(exact: the same best set and score as the pruned per-game search), so it grows ~7x per ply:
depth 1: 0.8 ms, 2: 2.5 ms, 3: 23 ms, 4: 240 ms, against 106 / 191 / 594 / 1529 ms for the per-game
search over the same positions. Depth <= 2 stays within a turn's budget at 512 games; depth 3
costs ~20x a random-opponent turn; depth 4 is still 6x faster than per game but dominates the
turn; at depth 5 both take ~2 s for 512 games.
"""
from earl_jax.envs.vector.codec import ObservationCodec
from earl_jax.envs.vector.env import VectorTextEnv
from earl_jax.envs.vector.parser import parse_actions
from earl_jax.envs.vector.per_game import PerGameVectorEnv, make_vector_env
from earl_jax.envs.vector.step import NO_WINNER, VectorStep

__all__ = ["NO_WINNER", "ObservationCodec", "PerGameVectorEnv", "VectorStep", "VectorTextEnv", "make_vector_env",
           "parse_actions"]
