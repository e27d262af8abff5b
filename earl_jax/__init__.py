"""earl-jax: agentic reinforcement learning of language models in JAX, after EARL (arXiv 2510.05943)."""

__version__ = "0.1.0"
