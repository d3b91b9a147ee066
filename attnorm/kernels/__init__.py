"""How the math runs: ``torch.library`` operators (:mod:`.ops`) over three implementations
of one contract (``kernels/README.md``): :mod:`.reference` (pure torch), :mod:`.cpu` (native C)
and :mod:`.triton` (Triton), chosen by :mod:`.backends`; the shared row rules in :mod:`.rules`.
"""
