"""What the rules know about a model before it is built: its longest sequence, its vocabulary,
whether the pipeline can split it and whether tensor parallel can.

A model plugin declares these, light (no torch), as an object in the `trainkit.model_facts`
entry-point group under its model's name; `facts_for` finds them. A model without facts (torchvision,
import paths, plugins that declare none) gets `ModelFacts()`: the rules that need a fact stay silent.
The built-in transformer's and Hugging Face causal LM's facts are at the end of this module.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, Optional


class ModelFacts:
    """Defaults: nothing known, and the model may be split into pipeline stages."""

    splits_into_stages = True  # an nn.Sequential of blocks that the pipeline splits at module names
    # not an nn.Sequential: the pipeline traces it and cuts it only at strategy.split_points (validate refuses
    # a pipeline that names none, instead of preflight at run time); a module to cut at, for the message
    needs_split_points = False
    split_point_example = ""
    # every parameter-owning layer has reset_parameters() (what `model.init: seeded` runs); "" if so,
    # else why not and what to use
    not_seedable = ""
    positions_key = "args"  # the model.args key that sets the longest sequence (for messages)
    # "" when the model takes TokensWithPositions (token ids with position ids that restart at each packed
    # sample) and keeps the samples apart (runtime.packed_sequences); else why not, for `data.packing`
    packing_refusal = ("it takes token ids only, so samples packed into one sequence would attend to each "
                       "other; use a Hugging Face model (hf_causal_lm), or data.packing: false")

    # the model.args names the factory takes, when the plugin declares them: validate refuses any other (a
    # typo, or `lora` on a model without adapters) instead of the factory's TypeError at run time; None:
    # not declared, not checked (tests/test_model_facts.py keeps the built-in ones equal to the signatures)
    argument_names: Optional[frozenset] = None

    def max_positions(self, args: dict) -> Optional[int]:
        """The longest sequence the model is built for, when its args say it (validate; no imports)."""
        return None

    def split_points_for(self, stages: int) -> Optional[list[str]]:
        """Module names that cut the model into `stages` pipeline stages, where the family knows good ones
        (`trainkit init` writes them); None: the user must choose."""
        return None

    def vocab_and_positions(self, args: dict) -> tuple[Optional[int], Optional[int]]:
        """(vocabulary size, longest sequence), possibly importing the model's library (preflight).

        Raises:
            LookupError: the args name something the library does not know (message for the user).
        """
        return None, self.max_positions(args)

    def loads_pretrained(self, args: dict) -> bool:
        """The runtime reads pretrained weights into the built model (`runtime.pretrained`)."""
        return False

    def quantized_base(self, args: dict) -> Optional[str]:
        """The 4-bit format of a frozen base under adapters (QLoRA), when the args ask for one."""
        return None

    def missing_inputs(self, args: dict) -> list[tuple[tuple, str]]:
        """(model.args path, message) for what the model reads at run time that is not on this machine: as
        data paths, checked by `validate --deep`, `plan` and `run`, not by `validate` (a recipe is often
        validated where the model is not: CI, a laptop)."""
        return []

    def args_problems(self, args: dict) -> list[tuple[tuple, str]]:
        """(path under model.args, message) for what is wrong with `args` before anything is built (validate;
        no torch)."""
        return []

    def tensor_parallel_refusal(self, tp: int, args: dict) -> Optional[str]:
        """Why the model built from `args` cannot be split over `tp` tensor-parallel ranks, or None if it can
        (validate; no imports). `args`: the recipe's model.args (heads and widths must divide by tp)."""
        return ("it declares no tensor-parallel plan; use parallel.tp: 1, or a model whose plugin declares one "
                "(a `tensor_parallel_plan()` method on the module, and model facts whose `tensor_parallel_refusal` "
                "accepts the tp; docs/plugins.md)")


@lru_cache(maxsize=None)
def _declared() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="trainkit.model_facts")}


def facts_for(model_name: str) -> ModelFacts:
    """The facts a model plugin declares (ModelFacts() when it declares none or they fail to load)."""
    ep = _declared().get(model_name)
    if ep is None:
        return TorchvisionFacts(model_name) if TorchvisionFacts.describes(model_name) else ModelFacts()
    try:
        facts = ep.load()
    except Exception:  # a broken third-party declaration must not break validation of other recipes
        return ModelFacts()
    return facts() if isinstance(facts, type) else facts


def builds_seeded(spec, shards_parameters: bool) -> bool:
    """Whether `model.init` resolves to a seeded build (on the meta device, each rank filling only what it
    keeps) under a strategy that does (or does not) shard parameters. A QLoRA base is built whole whatever
    `auto` would say: its 4-bit weights are quantized from each whole weight's values, before any sharding."""
    if facts_for(spec.name).quantized_base(dict(spec.args)):
        return False
    return spec.init == "seeded" or (spec.init == "auto" and shards_parameters)


def unknown_arguments(facts: ModelFacts, model_name: str, args: dict) -> list[tuple[tuple, str]]:
    """(path under model.args, message) for each argument the model's declared `argument_names` lack."""
    if facts.argument_names is None:
        return []
    takes = ", ".join(sorted(facts.argument_names))
    return [((name,), (f"{model_name} takes no argument {name!r}"
                       + (" (LoRA adapters are built for Hugging Face models: hf_causal_lm)" if name == "lora" else "")
                       + f"; it takes: {takes}")) for name in args if name not in facts.argument_names]


# --------------------------------------------------------------------------- built-in models' facts
class MLPFacts(ModelFacts):
    """trainkit.models.mlp: an nn.Sequential of Linear and ReLU layers."""

    argument_names = frozenset({"in_features", "hidden", "num_classes", "depth"})


class TransformerFacts(ModelFacts):
    """trainkit.models.transformer: an nn.Sequential of blocks (the pipeline splits at layers.N)."""

    argument_names = frozenset({"vocab_size", "dim", "layers", "heads", "kv_heads", "seq_len", "ffn_hidden",
                                "rope_theta", "norm_eps"})
    positions_key = "seq_len"
    packing_refusal = ("its attention is causal over the whole sequence (no document mask), so samples packed into "
                       "one sequence would attend to each other; use a Hugging Face model (hf_causal_lm), or "
                       "data.packing: false")

    def max_positions(self, args: dict) -> Optional[int]:
        return args.get("seq_len", 512)

    def vocab_and_positions(self, args: dict) -> tuple[Optional[int], Optional[int]]:
        return args.get("vocab_size"), args.get("seq_len", 512)

    def tensor_parallel_refusal(self, tp: int, args: dict) -> Optional[str]:
        """Its plan (Transformer.tensor_parallel_plan) splits the heads, the feed-forward width and the
        vocabulary; the model's defaults are TransformerConfig's."""
        dim, heads = args.get("dim", 256), args.get("heads", 4)
        ffn_hidden = args.get("ffn_hidden") or 64 * -(-int(8 * dim / 3) // 64)  # TransformerConfig.hidden
        return indivisible_by(tp, {"heads": heads, "kv_heads": args.get("kv_heads") or heads,
                                   "ffn_hidden": ffn_hidden, "vocab_size": args.get("vocab_size")}, "model.args")


RESNET_SPLIT_POINTS = {2: ["layer3"], 3: ["layer2", "layer3"], 4: ["layer2", "layer3", "layer4"]}


class TorchvisionFacts(ModelFacts):
    """torchvision.<name>: a classification model that is not an nn.Sequential (ResNet, ViT, ...), so the
    pipeline traces it and needs split points."""

    needs_split_points = True

    def __init__(self, model_name: str) -> None:
        short = model_name.partition(".")[2]
        self._resnet = short.startswith(("resnet", "resnext", "wide_resnet"))
        self.split_point_example = "layer3" if self._resnet else ""

    def split_points_for(self, stages: int) -> Optional[list[str]]:
        """A ResNet's residual stages (layer1..layer4) are its natural cuts; layer3 holds most of the
        blocks, so 2 stages cut before it."""
        return RESNET_SPLIT_POINTS.get(stages) if self._resnet else None

    def args_problems(self, args: dict) -> list[tuple[tuple, str]]:
        if "lora" in args:  # the models' own keyword arguments are only known once torchvision is imported
            return [(("lora",), "torchvision models take no lora argument (LoRA adapters are built for Hugging "
                                "Face models: hf_causal_lm)")]
        return []

    @staticmethod
    def describes(model_name: str) -> bool:
        """Whether `model_name` is written `torchvision.<name>` (the resolver's form for these models)."""
        return model_name.startswith("torchvision.") and ":" not in model_name


MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


LORA_KEYS = {"r", "alpha", "dropout", "target_modules", "quantize_base"}
QUANTIZED_BASES = ("nf4",)  # QLoRA's 4-bit NormalFloat (torchao), as torchtune and bitsandbytes


class HFCausalLMFacts(ModelFacts):
    """trainkit.models.hf: a transformers causal LM built from `args.config` (not an nn.Sequential)."""

    argument_names = frozenset({"config", "pretrained", "lora"})
    splits_into_stages = False
    not_seedable = ("transformers initialises its layers with the model's own _init_weights, and its norm layers "
                    "(e.g. LlamaRMSNorm) have no reset_parameters() for seeded init to run; use model.init: "
                    "constructor (or auto)")
    positions_key = "config"
    packing_refusal = ""  # position ids reach transformers' mask (block-causal at each restart) and rotary tables

    def loads_pretrained(self, args: dict) -> bool:
        return bool(args.get("pretrained"))

    def args_problems(self, args: dict) -> list[tuple[tuple, str]]:
        from .pretrained_dir import directory_problems

        problems = []
        if bool(args.get("config")) == bool(args.get("pretrained")):
            problems.append(((), "give exactly one of config (a new model from a config) or pretrained (a local "
                                 "save_pretrained directory)"))
        if args.get("pretrained") and not self.missing_inputs(args):  # a directory that is here must be sound
            problems += [(("pretrained",), message) for message in directory_problems(str(args["pretrained"]))]
        lora = args.get("lora")
        if lora is not None and (not isinstance(lora, dict) or set(lora) - LORA_KEYS):
            problems.append((("lora",), "lora takes {" + ", ".join(sorted(LORA_KEYS)) + "}"))
        elif lora and lora.get("quantize_base") not in (None, *QUANTIZED_BASES):
            problems.append((("lora", "quantize_base"), f"quantize_base is one of {', '.join(QUANTIZED_BASES)} (or "
                                                       "absent: the base in the run's precision)"))
        return problems

    def missing_inputs(self, args: dict) -> list[tuple[tuple, str]]:
        from pathlib import Path

        directory = args.get("pretrained")
        if not directory or Path(str(directory)).expanduser().is_dir():
            return []
        return [(("pretrained",), f"pretrained directory not found: {directory} (models are never downloaded; "
                                  "give a local save_pretrained directory)")]

    def quantized_base(self, args: dict) -> Optional[str]:
        lora = args.get("lora")
        return lora.get("quantize_base") if isinstance(lora, dict) else None

    def max_positions(self, args: dict) -> Optional[int]:
        config = args.get("config")
        if args.get("pretrained"):
            from .pretrained_dir import read_config

            config = read_config(str(args["pretrained"]))
        if isinstance(config, dict):
            for key in MAX_POSITION_KEYS:
                if isinstance(config.get(key), int):
                    return config[key]
        return None

    def vocab_and_positions(self, args: dict) -> tuple[Optional[int], Optional[int]]:
        config = self._config(args)
        described = config.to_dict()
        return getattr(config, "vocab_size", None), next(
            (described[k] for k in MAX_POSITION_KEYS if isinstance(described.get(k), int)), None)

    def tensor_parallel_refusal(self, tp: int, args: dict) -> Optional[str]:
        """transformers' plans split the attention heads, the MLP width and the vocabulary; checked as the
        recipe writes them (a size it leaves to the model type's default is checked when the model is split,
        as are the model type's plan and a tying the config does not write)."""
        config = args.get("config") if isinstance(args.get("config"), dict) else {}
        if config.get("tie_word_embeddings") is True:
            return ("tie_word_embeddings: true shares the embedding with the output head, which tensor parallel "
                    "would shard twice and untie; set model.args.config.tie_word_embeddings: false")
        heads = config.get("num_attention_heads")
        return indivisible_by(tp, {"num_attention_heads": heads,
                                   "num_key_value_heads": config.get("num_key_value_heads") or heads,
                                   "intermediate_size": config.get("intermediate_size"),
                                   "vocab_size": config.get("vocab_size")}, "model.args.config")

    @staticmethod
    def _config(args: dict) -> Any:
        """The transformers config the recipe builds, or LookupError with a message."""
        from .problems import did_you_mean

        config = dict(args.get("config") or {})
        if args.get("pretrained"):
            from .pretrained_dir import read_config

            config = {k: v for k, v in (read_config(str(args["pretrained"])) or {}).items()
                      if not k.startswith("_") and k not in ("architectures", "transformers_version")}
        model_type = config.pop("model_type", None)
        try:  # deferred: transformers is an optional extra and slow to import
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
        except ImportError:
            raise LookupError("model hf_causal_lm needs Hugging Face transformers: pip install 'trainkit-recipes[hf]'") from None
        if model_type not in CONFIG_MAPPING_NAMES:
            known = sorted(CONFIG_MAPPING_NAMES)
            raise LookupError(f"unknown Hugging Face model_type '{model_type}'{did_you_mean(str(model_type), known)} "
                              f"({len(known)} known to transformers, e.g. llama, gpt2, qwen2, mistral)")
        return CONFIG_MAPPING[model_type](**config)


def indivisible_by(tp: int, sizes: dict[str, Any], where: str) -> Optional[str]:
    """Why the sizes a tensor-parallel plan splits evenly over `tp` ranks do not all divide by it, or None
    (a size of None, left to the model's default, is not checked)."""
    bad = [f"{name} {n}" for name, n in sizes.items() if isinstance(n, int) and n % tp]
    if not bad:
        return None
    return (f"{where} {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by tp {tp} (tensor "
            f"parallel gives each rank 1/{tp} of the heads, the feed-forward width and the vocabulary); make "
            f"{'it' if len(bad) == 1 else 'them'} a multiple of {tp} or choose a tp that divides "
            f"{'it' if len(bad) == 1 else 'them'}")
