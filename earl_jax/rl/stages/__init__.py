"""The stages the loop runs, each under its own layout: the rollout (where games decode, with which programs), the
experience stage (old log-probs, advantages) and the train stage (PPO epochs), the policy bundle they share, the
weights moved between layouts (the Data Dispatcher's side of the loop), batch versions and greedy evaluation."""
