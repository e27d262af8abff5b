"""The algorithm: advantage estimators and policy losses (registered by name), log-probs, the optimizer, the
experience and train micro-batch steps as pure functions, and length-grouped packing."""
