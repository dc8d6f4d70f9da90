"""Hugging Face transformers causal LMs built from a config in the recipe, or from a local pretrained
directory (never downloaded), optionally with PEFT LoRA adapters:

    model: {name: hf_causal_lm, args: {config: {model_type: llama, hidden_size: 256, ...}}}
    model: {name: hf_causal_lm, args: {pretrained: models/my-llama, lora: {r: 8, target_modules: [q_proj, v_proj]}}}

`AutoConfig.for_model(model_type, **config)` then `AutoModelForCausalLM.from_config`: random
weights, no hub access. The wrapper returns the logits tensor, so tasks and strategies see the same
`tokens -> logits` module as the built-in transformer. Runs under DDP, FSDP (wrap the model's
decoder-layer class, e.g. `LlamaDecoderLayer`) and DeepSpeed; not the pipeline strategy (the model
is not an nn.Sequential of blocks). Tensor parallel with the plan transformers declares for the
model family (`tensor_parallel_plan`). Needs the optional extra: `pip install 'trainkit-recipes[hf]'`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from .inputs import TokensWithPositions

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's (and QLoRA's) defaults: elements per scale, scales per scale
NF4_SHARDABLE = 16  # an NF4 weight keeps at least this many groups of scales, so FSDP can split it 2, 4, 8 or 16 ways


def nf4_scaler_block(elements: int) -> int:
    """How many block scales torchao quantizes together (double quantization): 256, as QLoRA does, where the
    weight's blocks of 64 make a multiple of 16 x 256 (Llama's layers); otherwise the largest group that
    leaves a multiple of 16 groups (e.g. 16 on Qwen2-0.5B's 896 x 896 projections: finer, more scale
    bytes, never less precise), so FSDP2 can still split the weight's groups evenly (torchao's NF4
    split needs that). The same for any world size: a run quantizes as its
    one-process reference does."""
    blocks = elements // NF4_BLOCK
    return math.gcd(NF4_SCALER_BLOCK, blocks // NF4_SHARDABLE) if blocks % NF4_SHARDABLE == 0 and \
        blocks >= NF4_SHARDABLE else math.gcd(NF4_SCALER_BLOCK, blocks)

MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# what transformers' tokenizers save beside a model (`save_pretrained` of a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


class HFCausalLM(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] of a transformers causal LM."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    pretrained_dir: Optional[str] = None  # a local save_pretrained directory the runtime reads the weights from
    quantized_base: Optional[str] = None  # "nf4": QLoRA, the adapted Linear layers' frozen weights in 4 bits

    def quantize_frozen_base(self) -> int:
        """QLoRA: replace the frozen weight of every Linear layer that carries LoRA adapters by torchao's NF4
        tensor (4-bit NormalFloat in blocks of 64, with their scales: ~0.52 bytes per element instead of 4;
        torchtune's QLoRA and bitsandbytes' nf4 use the same format). Called once the weights hold their
        values (the pretrained read) and before the strategy wraps the model; each forward dequantizes a
        layer's weight to the input's dtype (`linear_nf4`), so the adapters train in the run's precision.
        Returns how many weights were quantized (0 without `quantize_base`)."""
        from torchao.quantization import to_nf4

        layers = self.quantized_base_layers()
        for base in layers:
            base.weight = nn.Parameter(to_nf4(base.weight.detach(), block_size=NF4_BLOCK,
                                              scaler_block_size=nf4_scaler_block(base.weight.numel())),
                                       requires_grad=False)
        return len(layers)

    def quantized_base_layers(self) -> list[nn.Linear]:
        """The Linear layers whose frozen weight `quantize_frozen_base` holds in 4 bits (what the memory plan
        counts at ~0.52 bytes per element): those carrying LoRA adapters, with whole blocks of 64 elements (a
        layer without stays in the run's precision); none without `quantize_base`."""
        if self.quantized_base != "nf4":
            return []
        return [module.base_layer for module in self.model.modules()
                if getattr(module, "lora_A", None) is not None and isinstance(getattr(module, "base_layer", None), nn.Linear)
                and module.base_layer.weight.numel() % NF4_BLOCK == 0]

    def pretrained_name(self, parameter_name: str) -> str:
        """This module's state-dict name as the pretrained safetensors call it (`checkpoint_name`)."""
        return checkpoint_name(parameter_name)

    def after_seeded_init(self) -> None:
        """Built on the meta device and given seeded values (a pretrained directory under FSDP:
        runtime.materialize), LoRA's B matrices got their Linear's draw; PEFT starts them at zero, so
        the adapted model starts as the checkpoint. A's draw is PEFT's own (kaiming-uniform, a=sqrt(5))."""
        for module in self.modules():
            adapters = getattr(module, "lora_B", None)
            if isinstance(adapters, nn.ModuleDict):
                with torch.no_grad():
                    for linear in adapters.values():
                        linear.weight.zero_()

    def save_adapter(self, directory: str, state_dict: dict) -> bool:
        """Write the LoRA adapter directory (PEFT's `save_pretrained`: adapter_config.json and
        adapter_model.safetensors) from a full state dict of this module; False without adapters."""
        if not hasattr(self.model, "peft_config"):
            return False
        inner = {k.removeprefix("model."): v for k, v in state_dict.items()}  # PEFT picks its adapters' keys
        self.model.save_pretrained(directory, state_dict=inner, safe_serialization=True)
        return True

    def save_merged(self, directory) -> list[str]:
        """Write the model as a Hugging Face directory (`save_pretrained`, safetensors, fp32 master
        weights: `from_pretrained(..., torch_dtype=...)` casts on load), LoRA adapters folded into the base
        weights (PEFT's `merge_and_unload`: W + B A x alpha/r); and the tokenizer files of the pretrained
        directory, where it had them. Returns the files written. Merging changes this module in place."""
        import shutil
        from pathlib import Path

        dequantize_base(self.model)  # a 4-bit base is merged (and saved) as its dequantized fp32 values
        model = self.model.merge_and_unload() if hasattr(self.model, "peft_config") else self.model
        model.config.use_cache = True  # trainkit trains without the KV cache; generation wants it
        model.save_pretrained(directory, safe_serialization=True)
        if self.pretrained_dir:
            for tokenizer_file in TOKENIZER_FILES:
                source = Path(self.pretrained_dir) / tokenizer_file
                if source.is_file():
                    shutil.copy2(source, Path(directory) / tokenizer_file)
        return sorted(p.name for p in Path(directory).iterdir())

    @property
    def max_seq_len(self) -> Optional[int]:
        return max_positions(self.model.config.to_dict())

    def forward(self, tokens: Union[torch.Tensor, TokensWithPositions]) -> torch.Tensor:
        """Logits of token ids [B, T]; of packed sequences (`data.packing`), whose position ids restart at
        each sample: transformers makes its causal mask block-causal there (runtime.packed_sequences)."""
        if isinstance(tokens, TokensWithPositions):
            return self.model(input_ids=tokens.tokens, position_ids=tokens.position_ids, use_cache=False).logits
        return self.model(input_ids=tokens, use_cache=False).logits

    def tensor_parallel_plan(self, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
        """transformers' own plan for the model (`tp_plan`: the config's `base_model_tp_plan`, the vocabulary-
        sharded embedding and the head's `_tp_plan`) in torch's styles; with `loss_parallel`, the head's logits
        stay a Shard(-1) DTensor for torch's loss_parallel().

        Raises:
            RuntimeError: transformers declares no plan for the model, a style trainkit does not translate,
                or tied input and output embeddings.
        """
        plan, kind = getattr(self.model, "tp_plan", None), type(self.model).__name__
        if not plan:
            raise RuntimeError(f"transformers declares no tensor-parallel plan for {kind} (its config has no "
                               "base_model_tp_plan); use parallel.tp: 1 or a model family that has one (e.g. llama)")
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head is not None and embedding is not None and head.weight is embedding.weight:
            raise RuntimeError(f"{kind} ties its input and output embeddings, which tensor parallel would shard "
                               "twice and untie; set tie_word_embeddings: false in model.args.config")
        head_name = next((name for name, module in self.model.named_modules() if module is head), None)
        return {f"model.{name}": translated_style(style, name, keep_logits_sharded=loss_parallel and name == head_name)
                for name, style in plan.items()}


def translated_style(style: str, module: str, *, keep_logits_sharded: bool = False) -> ParallelStyle:
    """torch's ParallelStyle for one of transformers' plan strings (transformers.distributed.tensor_parallel
    registers what each means). Only the styles whose meaning torch's own expresses exactly; the others
    (packed, expert, MLA, norms whose gradients transformers all-reduces by hand) are refused."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if keep_logits_sharded and style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    styles = {
        "colwise": ColwiseParallel,  # weight rows (output features) split; replicated in, sharded out
        "rowwise": RowwiseParallel,  # weight columns split; sharded in, all-reduced out
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary split, sums
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),  # embedding width split
    }
    if style not in styles:
        raise RuntimeError(f"the transformers tensor-parallel plan shards {module} as '{style}', which trainkit "
                           f"does not translate to a torch ParallelStyle (it knows {', '.join(styles)}); use "
                           "parallel.tp: 1")
    return styles[style]()


def max_positions(config: dict) -> Optional[int]:
    for key in MAX_POSITION_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def hf_causal_lm(*, config: Optional[dict[str, Any]] = None, pretrained: Optional[str] = None,
                 lora: Optional[dict[str, Any]] = None) -> HFCausalLM:
    """A transformers causal LM: from `config` (which names its `model_type`; random weights), or from a
    local `pretrained` directory as `save_pretrained` writes it (its config.json; the weights are read
    from its safetensors by the runtime after the strategy has placed the model: `runtime.pretrained`).
    `lora`: PEFT LoRA adapters on the modules named ({r, alpha, dropout, target_modules}); the base is
    frozen, and with `quantize_base: nf4` (QLoRA) the adapted layers' base weights are held in 4 bits once
    their values are in (`HFCausalLM.quantize_frozen_base`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (config is None) == (pretrained is None):
        raise ValueError("model.args needs exactly one of config (a new model) or pretrained (a local directory)")
    if pretrained is not None:
        hf_config = AutoConfig.from_pretrained(pretrained, local_files_only=True, trust_remote_code=False)
        hf_config.use_cache = False
    else:
        options = dict(config)
        model_type = options.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.args.config needs model_type (e.g. llama, gpt2, qwen2)")
        options.setdefault("use_cache", False)
        hf_config = AutoConfig.for_model(model_type, **options)
    # fp32 master weights whatever dtype the checkpoint was saved in (its config's torch_dtype would
    # otherwise build a bf16 model): `precision:` decides the compute dtype, as for every model
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    lora = dict(lora or {})
    quantize_base = lora.pop("quantize_base", None)
    if lora or quantize_base:
        model = with_lora(model, **lora)
    wrapped = HFCausalLM(model)
    wrapped.pretrained_dir = pretrained
    wrapped.quantized_base = quantize_base
    return wrapped


def with_lora(model: nn.Module, *, r: int = 8, alpha: float = 16, dropout: float = 0.0,
              target_modules: Any = None) -> nn.Module:
    """PEFT's LoRA on `model` (the ecosystem's format: `save_pretrained` of it is an adapter directory that
    PEFT, vLLM and transformers load). The base weights are frozen; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def dequantize_base(model: nn.Module) -> None:
    """Turn NF4 weights (QLoRA's base) back into fp32 parameters in place (PEFT merges adapters into dense
    weights only)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and hasattr(weight, "get_original_weight"):  # torchao's NF4Tensor
            module.weight = nn.Parameter(weight.get_original_weight().float(), requires_grad=False)


def checkpoint_name(parameter_name: str) -> str:
    """The name a parameter of `HFCausalLM` has in the model's own safetensors: without the wrapper's
    `model.` and PEFT's `base_model.model.` prefixes and `.base_layer` infix."""
    name = parameter_name.removeprefix("model.")
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")
