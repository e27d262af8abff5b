"""The rollout's settings: the batch of games, the answer budget, sampling, and how the decode loop is run."""

from __future__ import annotations

import dataclasses
from typing import Literal

from earl_jax.cli import field_help as _f
from earl_jax.models.paged_cache import PAGE_SIZES


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """rollout: games per iteration, answers, sampling"""

    groups: int = _f(16, "B: groups of games per iteration (each group shares a start seed)")
    group_size: int = _f(4, "G: games per group (GRPO / RLOO baselines compare within a group)")
    group_seeds: Literal["shared", "per_game"] = _f(
        "shared", "shared: a group's games share one seed (seat, opponent stream); per_game: each game its own seed "
                  "with the group's seat, so a confident policy against a near-deterministic opponent does not replay "
                  "one game G times (rl/matchups/game_seeds.py)")
    max_turn_tokens: int = _f(4, "max tokens the policy may generate per turn")
    turn_tokens_schedule: str = _f("", "length curriculum 'ITER:TOKENS,...': the per-turn token budget from iteration "
                                       "ITER on, e.g. '0:16,4:64,8:256' (empty: max_turn_tokens throughout)")
    constrain_moves: bool = _f(False, "the policy picks each move among the legal moves' tokens (a masked softmax; "
                                     "experience and train score it the same way), then the turn ends: no invalid "
                                     "answers, one scored token per turn (rollout/moves.py); false: free-text answers")
    stop_at_eos: bool = _f(True, "a turn ends at the end token; false: every answer uses its whole turn budget")
    max_turns: int = _f(32, "max agent turns per game (then truncated)")
    max_context: int = _f(2048, "max tokens per episode (then truncated, recorded)")
    temperature: float = _f(1.0, "sampling temperature")
    top_k: int = _f(0, "top-k sampling (0: off)")
    top_p: float = _f(1.0, "nucleus sampling threshold (1: off)")
    compact_finished: Literal["auto", "true", "false"] = _f(
        "auto", "finished games leave the decode batch (a smaller batch bucket): auto = on the CPU always, on "
                "accelerators from the second training rollout on (a cold first rollout compiles longer than it saves)")
    compile_ahead: Literal["auto", "true", "false"] = _f(
        "auto", "compile the next decode programs (cache size, compacted batch) and the experience / train programs "
                "of deferred widths on background threads: auto = on accelerators, the rollout's from the second "
                "rollout on")
    cache_growth: float = _f(0.0, "KV cache sizes as a game grows: 0 = the default buckets (x1.33-1.5 steps); 2 or 4 = "
                                  "fewer, larger sizes, so fewer decode programs compile")
    decode_impl: Literal["xla", "auto", "pallas"] = _f(
        "auto", "the decode step: auto = on one GPU from 2048 cached positions, Pallas attention and the Pallas "
                "matmuls a per-op benchmark measured faster (1.6x XLA at 16K contexts), else XLA; xla = XLA always; "
                "pallas = every Pallas kernel, one device (earl_jax/kernels/)")
    cache_dtype: Literal["bfloat16", "float32"] = _f(
        "bfloat16", "the KV cache's dtype: float32 makes the sampler's log-probs equal the trainer's to ~1e-6 "
                    "(tests/tasks/test_token_exact.py) at twice the cache memory")
    pipeline_groups: int = _f(1, "the batch decodes as this many groups that take turns on the device, so the host "
                                 "steps one group's games (tools, task steps, tokenization) while another decodes; "
                                 "same games as 1 (each game samples by its own key); one process, no league")
    slots: int = _f(0, "continuous batching: decode rows a rollout's games share (each process's, when the games are "
                       "split): a game that ends gives its row (emptied in place) to the next waiting game; same "
                       "games as 0 (each game samples by its own turn and id); rounded up to whole decode batches of "
                       "every pipeline group; 0 or >= the games: every game has a row from the start; -1: as many "
                       "rows as the rollout's memory holds at --rollout.max-context (the memory model; logged); "
                       "no league")
    kv_pages: int = _f(0, "paged KV cache: the rollout's cache (each pipeline group's) is this many pages of "
                          "--rollout.page-size positions its rows share (each takes pages as its context grows, gives "
                          "them back when its game ends), so memory follows the contexts, not rows x the longest; "
                          "when they run out the last game to start gives its row back and is recomputed later "
                          "(rollout/preempted); on a mesh split by kv head, whole on each batch shard; the XLA "
                          "decode step; 0: a contiguous cache per row; "
                          "-1: as many pages as the rollout's memory holds at --rollout.max-context beside the rest "
                          "(its weights, the rows' gathered layer, the train state; the memory model; logged)")
    page_size: int = _f(16, "paged KV cache: positions a page (8, 16, 32, 64 or 128)")
    max_staleness: int = _f(0, "K: the next rollouts run on a background thread while the current batch trains, "
                               "sampled with weights at most K train iterations older than those that train on "
                               "them (rl/loop/overlap.py); 0: one stage after the other, every batch fresh")
    token_budget: int = _f(0, "partial rollouts: an iteration's rollout ends once its answers reach this many tokens "
                              "(and some group has finished); the groups whose games all ended train, the others are "
                              "carried whole into the next iteration's rollout, first in its pool, their episodes "
                              "continued under the new weights (rl/loop/partial.py); 0: every game plays to its end")
    budget_min_ended: float = _f(0.0, "partial rollouts: the share of the rollout's groups that must have ended "
                                      "before --rollout.token-budget stops it, so that a budget-cut iteration trains "
                                      "at least that share (where groups end together, 0 cuts some iterations to "
                                      "one group); 0: one group")
    drafts: int = _f(0, "K: speculative decoding of free-text answers: each answer is guessed to be the one that "
                        "followed the same context tail (its last 8 tokens) in the last 2 training rollouts, and each "
                        "decode step verifies the guess's next K tokens in one forward with the exact sampling rule, "
                        "so the answers' distribution is unchanged and a row that follows its guess advances up to "
                        "K + 1 tokens a step (rollout/speculate.py); pays where answers repeat (a trained policy), as "
                        "rollout/draft_acceptance shows; 0: off; not with constrained moves; one process only")
    split_processes: bool = _f(True, "in a multi-process job whose rollout mesh holds a whole model per process, each "
                                     "process plays only its share of the games (rollout/process_split.py)")

    def __post_init__(self):
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        for name in ("groups", "group_size", "max_turn_tokens", "max_turns", "max_context"):
            need(getattr(self, name) > 0, name, "must be positive")
        need(self.top_k >= 0, "top_k", "must be >= 0")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.max_context > self.max_turn_tokens, "max_context", "must exceed max_turn_tokens")
        need(self.pipeline_groups > 0, "pipeline_groups", "must be positive")
        need(self.groups * self.group_size % self.pipeline_groups == 0, "pipeline_groups",
             f"must divide the batch (groups x group_size = {self.groups * self.group_size} games)")
        need(self.slots >= -1, "slots", "must be >= 0 (0: off) or -1 (as many rows as memory holds)")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0: synchronous)")
        need(self.token_budget >= 0, "token_budget", "must be >= 0 (0: off)")
        need(0 <= self.budget_min_ended <= 1, "budget_min_ended", "must be a share in [0, 1]")
        need(self.drafts >= 0, "drafts", "must be >= 0 (0: off)")
        need(self.kv_pages >= -1, "kv_pages", "must be >= 0 (0: contiguous caches) or -1 (as many as memory holds)")
        need(not (self.kv_pages == -1 and self.slots == -1), "kv_pages", "-1 sizes the pages for the rows "
             "--rollout.slots gives (or every game): give --rollout.slots a number, or --rollout.kv-pages one")
        need(self.page_size in PAGE_SIZES, "page_size", f"must be one of {', '.join(map(str, PAGE_SIZES))}")
        need(not (self.kv_pages and self.decode_impl == "pallas"), "kv_pages", "a paged cache decodes with XLA's "
             "step (the Pallas step reads contiguous caches): use --rollout.decode-impl auto or xla, or "
             "--rollout.kv-pages 0")
        need(not (self.drafts and self.constrain_moves), "drafts", "a constrained move is one token a turn: nothing "
             "to draft; use --rollout.drafts 0 or --rollout.constrain-moves false")
        need(self.cache_growth == 0 or self.cache_growth >= 1.5, "cache_growth",
             "must be 0 (default buckets) or >= 1.5")
        try:
            schedule = parse_schedule(self.turn_tokens_schedule)
        except ValueError as e:
            raise ValueError(f"turn_tokens_schedule: {e} (got {self.turn_tokens_schedule!r})") from None
        need(all(t < self.max_context for _, t in schedule), "max_context", "must exceed every scheduled turn budget")
        if self.constrain_moves:
            need(self.top_k == 0 and self.top_p == 1.0, "constrain_moves", "samples the legal moves' softmax whole: "
                 "top_k / top_p do not apply, leave them off")
            need(not self.turn_tokens_schedule, "constrain_moves", "answers are one move token: a turn-token schedule "
                 "has nothing to schedule")
            need(self.max_turn_tokens >= 2, "max_turn_tokens", "constrained moves take 2 tokens a turn (move, stop)")

    @property
    def sampling(self):
        from earl_jax.rollout.sampling import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def batch_size(self) -> int:
        return self.groups * self.group_size

    def turn_tokens(self, iteration: int) -> int:
        """The per-turn token budget at `iteration` (the schedule's last entry at or before it)."""
        budget = self.max_turn_tokens
        for start, tokens in parse_schedule(self.turn_tokens_schedule):
            if iteration >= start:
                budget = tokens
        return budget


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """'0:16,4:64' -> [(0, 16), (4, 64)]: iterations strictly ascending from 0, budgets positive."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{item!r} is not ITER:TOKENS")
        out.append((int(parts[0]), int(parts[1])))
    if out and (out[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(out, out[1:]))):
        raise ValueError("iterations must start at 0 and strictly ascend")
    if any(t <= 0 for _, t in out):
        raise ValueError("token budgets must be positive")
    return out
