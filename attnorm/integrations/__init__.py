"""Integrations of attnorm with model libraries.

* :mod:`attnorm.integrations.transformers`: ``patch(model, normalizer)`` runs the
  self-attention of a Hugging Face ``transformers`` model through :func:`attnorm.attention`.
"""
