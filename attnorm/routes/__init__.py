"""How :func:`attnorm.attention` computes ``normalizer(scale q k^T + additive, mask) v``.

=================== ============================================ ===============================
route               when                                         memory beyond q, k, v, out
=================== ============================================ ===============================
:mod:`.sdpa`        logit scalings: softmax with temperature,    none: one ``scaled_dot_product_attention``
                    Scalable-Softmax (fixed or learnable); on    call on ``c q``
                    the CPU not under a structured mask whose
                    blocks skip most scores
                    (``attention.BLOCKED_SHARE``)
:mod:`.fused`       sparsemax, alpha-entmax, top-k, Self-        per-row statistics (Triton kernels,
                    Adjusted on CUDA (or ``backend="triton"``)   no ``Lq x Lk`` matrix)
:mod:`.decoding`    few query rows (decoding) of Self-Adjusted   per-split partials (split-K Triton
                    without gradients, where :mod:`.fused` runs  kernel); the route of each family:
                                                                 ``decoding.DECODING_ROUTES``
materialised        ``return_weights=True``; few query rows      the ``Lq x Lk`` weights
                    (decoding: scores as rows of the row kernels)
:mod:`.blocked`     everything else (any normalizer, any device) one block of query rows' scores;
                                                                 the backward recomputes each block
=================== ============================================ ===============================

:mod:`.common` turns the user's mask into what each route takes: allowed counts,
rows with no allowed key, the kernels' :class:`~attnorm.kernels.rules.AttentionMask`.
"""
