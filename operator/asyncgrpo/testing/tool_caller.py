"""A tiny model taught one tool-call conversation, so an end-to-end run calls a real tool.

A tiny random model never writes a parseable tool call, so a run of an example task with it
would never reach the task's environment. This writes the same tiny checkpoint vLLM serves
(`asyncgrpo.trainer.tiny_tokenizer.save_tiny_checkpoint`: the project's trained tokenizer and
TRL's own Qwen3 template) and fine-tunes it, full weights, on one fixed conversation per
prompt, rendered by that template with the task's real tool schemas:

    user prompt -> assistant: <tool_call>{name, arguments}</tool_call><|im_end|>

The loss is on the assistant's call only; what the model writes after a tool result is left
random (a first try at teaching the turn after the result too, at a higher learning rate,
made the model write that turn first: not pursued). Nothing
downstream is faked: vLLM samples the call, TRL's worker parses it from the text and calls
the environment's method, and the result the model sees is the environment's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def _first_turn_ids(tokenizer, prompt: str, tools: list, call: dict,
                    system: str | None = None):
    """(input ids, loss mask) of the first turn: the prompt as TRL's worker renders it (the
    template with the tools' schemas and the generation prompt), then the call, learned."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    turn = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    answer = ('<tool_call>\n{"name": "' + call["name"] + '", "arguments": '
              + json.dumps(call["arguments"]) + '}\n</tool_call><|im_end|>')
    # the template renders an assistant message with this call as this very text, so the
    # learned call is what TRL's Qwen3 response parser reads
    rendered = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": dict(call)}]}], tools=tools,
        tokenize=False)
    if answer not in rendered:
        raise AssertionError(f"the template renders the call otherwise: {rendered[-200:]!r}")
    prompt_ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, [False] * len(prompt_ids) + [True] * len(answer_ids)


def save_tool_calling_checkpoint(path: str | Path, *, prompts: list[str], tools: list,
                                 call: dict, system: str | None = None, steps: int = 120,
                                 lr: float = 3e-3, train_on: int = 4, seed: int = 0) -> dict:
    """Write the tiny checkpoint at `path`, fine-tuned for `steps` steps on the call; then
    greedy decoding (`generate`) of every prompt must give the call's exact text, or this
    raises. `tools` are the environment's bound
    methods (as TRL passes them to the template), `call` the `{name, arguments}` to learn,
    `train_on` how many of the prompts it is trained on (the rest only checked).
    Returns what it measured: seconds, steps, final loss, sequence lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    t0 = time.monotonic()
    path = Path(path)
    save_tiny_checkpoint(path, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = [_first_turn_ids(tokenizer, p, tools, call, system) for p in prompts]
    train = rows[:train_on]
    width = max(len(ids) for ids, _ in train)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in train])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in train])
    labels = input_ids.clone()
    learned = torch.tensor([m + [False] * (width - len(m)) for _, m in train])
    labels[~learned] = -100
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = None
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    trained_s = time.monotonic() - t0
    # greedy decoding of the first turn gives the call, for every prompt
    misses = []
    with torch.no_grad():
        for (ids, mask), prompt in zip(rows, prompts):
            start = mask.index(True)
            out = model.generate(torch.tensor([ids[:start]]), do_sample=False,
                                 max_new_tokens=len(ids) - start + 1)
            text = tokenizer.decode(out[0, start:], skip_special_tokens=False)
            if not text.startswith(tokenizer.decode(ids[start:], skip_special_tokens=False)):
                misses.append((prompt, text))
    if misses:
        raise AssertionError(f"after {steps} steps greedy decoding misses the call: {misses[:2]}")
    model.save_pretrained(path)
    return {"seconds": time.monotonic() - t0, "trained_s": trained_s, "steps": steps,
            "loss": float(loss.detach()), "tokens": [len(ids) for ids, _ in rows]}
