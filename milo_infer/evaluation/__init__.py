"""Accuracy at equal bytes: methods, evaluation runs, their tables, and the demo."""
