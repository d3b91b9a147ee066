"""Tests for attnorm.diagnostics: every quantity against a hand-checked case and a brute-force reference."""
