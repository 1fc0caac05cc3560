"""A verifiable task suite for the tiny dLLMs: seeded generators, held-out
splits, exact-match scoring and calibration pairs (see suite.py, generators.py)."""
from .suite import (BLOCK_LENGTH, GEN_LENGTH, SPLITS, TASKS, Problem, Task, calibration_pairs,
                    encode, exact_match, pack, problems, sample, split_of, task_names)
from .vocab import CHAT_TEMPLATE, WORDS, task_tokenizer, vocab_ids

__all__ = ["TASKS", "Task", "Problem", "GEN_LENGTH", "BLOCK_LENGTH", "SPLITS", "problems", "sample",
           "calibration_pairs", "exact_match", "pack", "encode", "split_of", "task_names",
           "task_tokenizer", "vocab_ids", "WORDS", "CHAT_TEMPLATE"]
