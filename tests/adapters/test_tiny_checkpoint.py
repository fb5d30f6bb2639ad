"""The tiny tokenizer and checkpoint that vLLM serves and the trainer trains."""

from __future__ import annotations


def test_tokenizer_fits_model_and_round_trips():
    from asyncgrpo.trainer.tiny_tokenizer import VOCAB_SIZE, tiny_tokenizer

    tok = tiny_tokenizer()
    assert len(tok) <= VOCAB_SIZE
    text = 'Héllo 🙂 {"name": "python"} 12 + 30 = 42\n\tdef f(): pass'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < VOCAB_SIZE and tok.decode(ids) == text  # byte level: nothing is lost
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert tok.convert_ids_to_tokens(tok("<think>")["input_ids"]) == ["<think>"]
    assert tiny_tokenizer()(text)["input_ids"] == ids  # deterministic training


def test_checkpoint_loads_and_trl_recognises_its_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    from asyncgrpo.trainer.tiny_tokenizer import VLLM_HEAD_DIM, save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tok.chat_template == qwen3_chat_template
    assert get_training_chat_template(tok)  # TRL patches only templates it knows
    assert model.config.head_dim == VLLM_HEAD_DIM
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    messages = [{"role": "user", "content": "What is 7 * 8?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    import torch

    assert model(input_ids=torch.tensor([ids])).logits.shape[-1] == 512
