"""Datasets and prompt formats.

- `types`: the examples every loader returns (PromptExample, SFTExample, PreferencePair) and
  their token ids.
- `sources`: `load_split(source, split)` from a Hugging Face hub name or a local file / folder.
- one module per task, each with its loader and its `TaskSpec` (`task_spec`): `tldr`, `nobots`
  (No Robots), `gsm8k`; and `arithmetic`, the offline two-digit addition task.
- `task_registry`: the tasks by `config.task.name`, and the functions the stages call.
"""
