"""GRPO's plain-Python half: the rows it samples from and the rewards that judge the completions.

- ``rows``: prompts to sample completions for (instruction rows, conversations) and the columns the
  rewards read;
- ``rewards``: the reward functions (the built-ins and your own, TRL's signature), calling them
  safely, one-line failures;
- ``reward_builtins``: exact_match, regex, number_match (GSM8K-style), length;
- ``metrics``: what a step tallies (rewards, spread, lengths, KL) and the event its means make.

The sampling, the loss and the training live in studio/engine/grpo.py. No torch here.
"""
