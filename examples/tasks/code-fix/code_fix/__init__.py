"""A code-fix task: a small module with a bug and its tests; the model reads, edits and runs
them in its rollout's sandbox, and is scored by the tests run where it never ran.

`code_fix.env:CodeFix` is the TRL environment (`spec.harness.environment`, with
`spec.sandboxes`), `code_fix/data/train.jsonl` the rows: `prompt`, `files` (the initial
files, as JSON), `editable` (what the model may change) and `test_command` (the task
author's contract of docs/sandboxes.md, "Harness environment"). docs/tasks.md walks through it.
"""
