"""Tests for the normalizer modules, one file per family, plus their float64 references."""
