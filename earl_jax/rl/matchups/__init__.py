"""Who the policy plays: the opponent curriculum, a league of frozen snapshots, matchmaking, the seeds and the
opponent of each GRPO group."""
