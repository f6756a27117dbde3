"""Datasets and prompt formats.

- `types`: the examples every loader returns (PromptExample, SFTExample, PreferencePair).
- `sources`: `load_split(source, split)` from a Hugging Face hub name or a local file / folder.
- one module per recipe of the paper: `tldr`, `nobots` (No Robots), `gsm8k`; and `arithmetic`,
  the offline two-digit addition task.
"""
