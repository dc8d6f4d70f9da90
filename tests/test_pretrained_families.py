"""Pretrained directories of the Hugging Face families users bring besides Llama (issue 39): a
Qwen2-style model (biases on q/k/v, the head tied to the embedding) and a Mistral-style one (sliding-window
attention in its config), each saved by `save_pretrained` in bf16 safetensors here, no download. Read as
every strategy reads them (`hf_causal_lm(pretrained=...)`, then the runtime's reader: DCP's Hugging Face
storage reader, in one process), with LoRA adapters on, the model gives `from_pretrained`'s logits.
In-process: what differs between families is the reader's names and tensors, not the collectives."""

from __future__ import annotations

import pytest
import torch

CONFIGS = {
    "qwen2": dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=16,
                    tie_word_embeddings=False),
}
pytestmark = pytest.mark.slow  # transformers imports DeepSpeed, which probes the machine with `uname`

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_pretrained_directory_of_another_family_loads_to_from_pretrained_logits(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainkit.models.hf import hf_causal_lm
    from trainkit.runtime.pretrained import pretrained_source

    options = dict(CONFIGS[family])
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / family)
    folder = str(tmp_path / family)

    model = hf_causal_lm(pretrained=folder, lora=LORA)
    left = pretrained_source(model).load_into(model)
    # everything else came from the directory; a head tied to the embedding is not stored apart (it is it)
    tied = {"model.base_model.model.lm_head.weight"} if CONFIGS[family]["tie_word_embeddings"] else set()
    assert all("lora_" in name or name in tied for name in left), left
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), reference(input_ids=tokens).logits
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()
    if CONFIGS[family]["tie_word_embeddings"]:  # one tensor, read once, shared as the checkpoint shares it
        inner = model.model.base_model.model
        assert inner.lm_head.weight.data_ptr() == inner.model.embed_tokens.weight.data_ptr()
