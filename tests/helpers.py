"""Builders the test modules share: tiny targets and drafters, oracles, statistics, training rows and arguments.

Test modules import from here (never from one another); fixtures that wrap these live in `conftest.py`.
"""

# --- targets, drafters, oracles and statistics (generation and model tests) ---

# --- training rows, arguments and CLI runs (training tests) ---
