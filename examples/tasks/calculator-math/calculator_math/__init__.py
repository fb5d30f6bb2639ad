"""A tool-using math task: the model may call a calculator, and is scored on its final answer.

`calculator_math.env:Calculator` is the TRL environment (`spec.harness.environment`),
`calculator_math.reward:final_answer` the reward (`spec.reward.functions[].module`), and
`calculator_math/data/train.jsonl` the prompts with their `answer` column. docs/tasks.md
walks through it.
"""
