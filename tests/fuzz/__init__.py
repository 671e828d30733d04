"""Fuzzing specjax's readers of untrusted model files (see run.py for the long run, test_fuzz.py for the short one)."""
