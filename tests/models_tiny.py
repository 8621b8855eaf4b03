"""A tiny seeded Llama target with a real ChatML tokenizer, for fast tests of the model code.

Same structure as SmolLM2 (GQA, ChatML with <|im_end|> = id 2; untied lm_head, so that answers
can be made to end), a few hundred tokens of vocabulary and two 32-wide layers: datagen and the
drafts run on it in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_adatree.models import eagle

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A tiny EAGLE head config (50-token vocabulary): the head's math, its loss and its export.
TINY_HEAD = eagle.HeadConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    vocab_size=50,
)
EOS_PULL = 0.8  # <|im_end|>'s logit on the mean final hidden state
CORPUS = [
    "Explain how a question about the water cycle, volcanoes and tides is answered.",
    "Write a short story, a poem and a friendly email about cats and dogs.",
    "def f(x): return x + 1  # numbers 0 1 2 3 4 5 6 7 8 9 and symbols ? ! : ;",
    "The capital of France is Paris. Give me practical tips for saving money.",
]


def make_tiny_target(folder: Path, seed: int = 0) -> Path:
    """Write a tiny HF Llama folder (weights, tokenizer, chat template) and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # point <|im_end|>'s output row along the typical final hidden
        # state, so that answers end early and often, as real ones do (a random model never
        # ends otherwise); the input embedding stays as it is.
        ids = torch.tensor([tok.encode(text).ids[:8] for text in CORPUS])
        mean = model.model(input_ids=ids).last_hidden_state.mean(dim=(0, 1))
        model.lm_head.weight[2] = EOS_PULL * mean / mean.norm() ** 2
    model.save_pretrained(folder, safe_serialization=True)
    return folder
