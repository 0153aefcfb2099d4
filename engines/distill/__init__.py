"""Distilling a draft for the target (`specgate distill`).

    prompts.py   what the target answers: the dev split minus the benchmarks' prompts, and templates
    data.py      the target writes the data: answers, and its hidden state at every position
    model.py     the EAGLE-style draft head as trained (training-time test included)
    train.py     soft cross-entropy to the target's distribution, checkpoints, agreement
"""
