"""Model cards for hf_vanilla_transformer checkpoints, generated from the config and the training results.

The YAML metadata is built with huggingface_hub's `ModelCardData` and `EvalResult`, so it parses and validates the
way the Hub reads it (`model-index` included); the body is rendered from `model_card_template.md`, which ships with
the package (`model_cards/template.md` links to it). Training scripts call `write_model_card` next to
`save_pretrained`.
"""

import shutil
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.pipelines import get_supported_tasks

from .auto_vanilla_transformer import HEADS
from .configuration_vanilla_transformer import GATED_FFN_TYPES

TEMPLATE_PATH = Path(__file__).with_name("model_card_template.md")
PLACEHOLDER_REPO_ID = "<user>/<model>"


def head_name(model_or_config: PreTrainedModel | PreTrainedConfig) -> str:
    """The head class a card describes: the model's class, else the config's `architectures`, else inferred."""
    if isinstance(model_or_config, PreTrainedModel):
        name = type(model_or_config).__name__
    elif model_or_config.architectures:
        name = model_or_config.architectures[0]
    elif model_or_config.is_encoder_decoder:
        name = "VanillaTransformerForConditionalGeneration"
    else:
        raise ValueError(
            "A decoder-only or encoder-only config does not say which head it belongs to: pass the model, "
            "or set config.architectures."
        )
    if name not in HEADS:
        raise ValueError(f"No model card for {name!r}; expected one of {sorted(HEADS)}.")
    return name


def described(descriptions: dict[Any, Any], field: str, value: Any) -> Any:
    """The card's entry for `field` = `value`; a value it has no entry for (one the config gained later) is named,
    not described as another."""
    if value not in descriptions:
        raise ValueError(f"The model card cannot describe {field}={value!r}: it describes {list(descriptions)}.")
    return descriptions[value]


def stack_kind(config: PreTrainedConfig) -> str:
    """The stacks the model runs, from its config (a task head's config names the stack it runs)."""
    return {("encoder", "decoder"): "encoder-decoder", ("decoder",): "decoder-only", ("encoder",): "encoder-only"}[
        tuple(config.stacks)
    ]


def stack_description(config: PreTrainedConfig, head: str) -> str:
    layers = {
        "decoder-only": f"{config.decoder_layers}",
        "encoder-only": f"{config.encoder_layers}",
        "encoder-decoder": f"{config.encoder_layers} + {config.decoder_layers}",
    }
    return f"{stack_kind(config)}, {layers[stack_kind(config)]} layers"


def paper(value: Any, paper_value: Any) -> str:
    """A config value in backticks, marked when it is the paper's choice."""
    return f"`{value}` (paper)" if value == paper_value else f"`{value}`"


def positions_description(config: PreTrainedConfig) -> str:
    rope = config.rope_parameters
    scaling = "" if rope["rope_type"] == "default" else f", {rope['rope_type']} scaling"
    details = {
        "sinusoidal": f", {config.sinusoidal_layout} sin/cos",
        "rope": f", theta = {rope['rope_theta']:g}{scaling}",
        "learned": f", at most {config.max_position_embeddings} positions",
        "none": "",
    }
    kind = config.position_embedding_type
    return paper(kind, "sinusoidal") + described(details, "position_embedding_type", kind)


def experts_description(config: PreTrainedConfig) -> str:
    if not config.num_experts:
        return "dense FFN (paper)"
    layers = "every layer" if config.moe_layer_frequency == 1 else f"every {config.moe_layer_frequency}th layer"
    return (
        f"{config.num_experts} experts, top-{config.num_experts_per_tok}, {config.num_shared_experts} shared, "
        f"{layers} of the {config.moe_stacks} stack(s)"
    )


TOKEN_EMBEDDING_ROWS = (
    "Embeddings scaled by sqrt(d_model)",
    "Source/target embeddings shared",
    "Output projection tied to embeddings",
    "Vocabulary",
)


def architecture_rows(config: PreTrainedConfig, head: str) -> list[tuple[str, str]]:
    """The card's architecture table: one row per variant axis, with the paper's value marked."""
    grouped = config.key_value_heads(config.decoder_attention_heads) != config.decoder_attention_heads
    kv_heads = f", {config.key_value_heads(config.decoder_attention_heads)} key/value heads" if grouped else ""
    ffn = f"{paper(config.ffn_type, 'relu')}, d_ff = {config.encoder_ffn_dim} / {config.decoder_ffn_dim}"
    if config.ffn_type in GATED_FFN_TYPES:
        ffn += f" (gated hidden size {config.gated_hidden_size(config.encoder_ffn_dim)})"
    rows = [
        ("Stacks", stack_description(config, head)),
        ("Model width", f"d_model = {config.d_model}"),
        ("Attention heads", f"{config.encoder_attention_heads} / {config.decoder_attention_heads}{kv_heads}"),
        ("Feed-forward", ffn),
        ("Normalisation", f"{paper(config.norm_type, 'layernorm')}, eps = {config.norm_eps:g}"),
        ("Norm position", paper(config.norm_position, "post")),
        ("Positions", positions_description(config)),
        ("Embeddings scaled by sqrt(d_model)", paper(config.scale_embedding, True)),
        ("Source/target embeddings shared", paper(config.share_encoder_decoder_embeddings, True)),
        ("Output projection tied to embeddings", paper(config.tie_word_embeddings, True)),
        ("Experts", experts_description(config)),
        ("Vocabulary", str(config.vocab_size)),
        (
            "Dropout (residual / attention / activation)",
            f"{config.dropout} / {config.attention_dropout} / {config.activation_dropout}",
        ),
    ]
    if head == "VanillaTransformerForImageClassification":
        poolings = {"mean": "pooled: mean over patches", "first": "pooled: [class] token"}
        pooling = described(poolings, "classifier_pooling", config.classifier_pooling)
        image = f"{config.image_size} pixels, {config.num_channels} channels, patches of {config.patch_size}"
        # An image has no vocabulary: the rows about token embeddings give way to the image's.
        rows = [row for row in rows if row[0] not in TOKEN_EMBEDDING_ROWS] + [("Image (ViT)", f"{image}; {pooling}")]
    return rows


def variant_tags(config: PreTrainedConfig, head: str) -> list[str]:
    """Hub tags that let readers find checkpoints by variant."""
    tags = [
        "vanilla-transformer",
        "custom_code",
        stack_kind(config),
        config.norm_type,
        f"{config.norm_position}-norm",
        f"ffn-{config.ffn_type}",
        f"positions-{config.position_embedding_type}",
    ]
    if config.num_experts:
        tags.append("mixture-of-experts")
    return tags


def default_limitations(config: PreTrainedConfig) -> list[str]:
    """Caveats that follow from the configuration."""
    limitations = [
        "Loading runs the Python files of this repository (`trust_remote_code=True`): read them first, or pin a "
        "`revision`.",
        f"The code was written against transformers {transformers.__version__} internals (attention interface, "
        "masking utilities, output capturing); other transformers versions may fail to load it.",
    ]
    if config.norm_position == "post":
        limitations.append(
            "Post-LN (the paper's placement) needs a learning-rate warm-up (§5.3) and gets unstable as depth grows; "
            "fine-tune with a warm-up too."
        )
    any_length = (
        "Sinusoidal/rotary positions accept any length, but quality drops on inputs much longer than in training."
    )
    lengths = {
        "learned": f"Learned positions: inputs longer than {config.max_position_embeddings} tokens fail.",
        "sinusoidal": any_length,
        "rope": any_length,
        "none": None,  # no positions: no caveat about length
    }
    if length := described(lengths, "position_embedding_type", config.position_embedding_type):
        limitations.append(length)
    if config.num_experts:
        limitations.append(
            "Mixture of Experts: keep the router's auxiliary losses on when fine-tuning"
            + (", and tokens over expert capacity skip the FFN." if config.expert_capacity_factor else ".")
        )
    return limitations


def eval_results(results: dict[str, float], dataset: str, task_type: str) -> list[EvalResult]:
    return [
        EvalResult(task_type=task_type, dataset_type=dataset, dataset_name=dataset, metric_type=name, metric_value=v)
        for name, v in results.items()
    ]


def clean_results(results: dict[str, Any] | None) -> dict[str, float]:
    """Metric name -> number; the `eval_`/`test_` prefixes of Trainer metrics are dropped."""
    cleaned = {}
    for name, value in (results or {}).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"results[{name!r}] = {value!r} is not a number.")
        cleaned[name.removeprefix("eval_").removeprefix("test_")] = float(value)
    return cleaned


def build_model_card(
    model_or_config: PreTrainedModel | PreTrainedConfig,
    *,
    repo_id: str | None = None,
    results: dict[str, float] | None = None,
    dataset: str | None = None,
    training_args: dict[str, Any] | None = None,
    plot_path: str | Path | None = None,
    description: str = "",
    language: str | list[str] | None = None,
    license: str = "apache-2.0",
    pipeline_tag: str | None = None,
    base_model: str | None = None,
    limitations: list[str] | None = None,
) -> ModelCard:
    """A model card for a model (or its config), its training recipe and its evaluation results.

    Args:
        model_or_config: the trained model, or its config (the head comes from `config.architectures`).
        repo_id: Hub id used in the loading example and as the model name.
        results: metric name -> value, e.g. `{"bleu": 27.3}` (Trainer's `eval_` prefixes are dropped); they go into
            the `model-index` metadata, which needs `dataset`.
        dataset: Hub dataset id the model was trained and evaluated on.
        training_args: hyper-parameters to list in the training recipe (name -> value).
        plot_path: an image of training curves; the card links to its file name (`write_model_card` copies it).
        description: a paragraph placed under the title.
        language, license, base_model: card metadata.
        pipeline_tag: Hub task, one transformers has a pipeline for; by default the head's (`auto_vanilla_transformer`).
        limitations: caveats added after the ones derived from the config.
    """
    config = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    head = head_name(model_or_config)
    declared = HEADS[head]
    auto_class, summary = declared.auto_class, declared.summary
    pipeline_tag = pipeline_tag or declared.pipeline_tag
    if pipeline_tag is not None and pipeline_tag not in get_supported_tasks():
        raise ValueError(
            f"pipeline_tag={pipeline_tag!r} is not a task transformers {transformers.__version__} has a pipeline for; "
            f"choose one of {sorted(get_supported_tasks())}, or None."
        )
    metrics = clean_results(results)
    if metrics and dataset is None:
        raise ValueError("results need the dataset they were measured on: pass dataset=<Hub dataset id>.")
    model_name = (repo_id or "vanilla-transformer").split("/")[-1]
    card_data = ModelCardData(
        language=language,
        license=license,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=variant_tags(config, head),
        datasets=[dataset] if dataset else None,
        metrics=list(metrics) or None,
        base_model=base_model,
        model_name=model_name,
        # model-index names the task evaluated, a Hub task: sequence-to-sequence where no pipeline tag applies.
        eval_results=eval_results(metrics, dataset, pipeline_tag or "text2text-generation") if metrics else None,
    )
    preprocessor, preprocessor_name = declared.preprocessor
    load = (
        f"from transformers import {preprocessor}, {auto_class}\n\n"
        f'{preprocessor_name} = {preprocessor}.from_pretrained("{repo_id or PLACEHOLDER_REPO_ID}", '
        "trust_remote_code=True)\n"
        f'model = {auto_class}.from_pretrained("{repo_id or PLACEHOLDER_REPO_ID}", trust_remote_code=True)\n'
    )
    if isinstance(model_or_config, PreTrainedModel):
        summary += f", {model_or_config.num_parameters():,} parameters"
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE_PATH),
        model_name=model_name,
        description=description,
        head_summary=summary,
        architecture=architecture_rows(config, head),
        dataset=dataset,
        training_args=training_args,
        plot_file=Path(plot_path).name if plot_path else None,
        results=metrics,
        transformers_version=transformers.__version__,
        usage=load + declared.usage,
        limitations=default_limitations(config) + list(limitations or []),
    )


def write_model_card(
    model_or_config: PreTrainedModel | PreTrainedConfig,
    output_dir: str | Path,
    *,
    results: dict[str, float] | None = None,
    dataset: str | None = None,
    training_args: dict[str, Any] | None = None,
    plot_path: str | Path | None = None,
    **card_fields: Any,
) -> ModelCard:
    """Write `README.md` (and a copy of the training plot) into `output_dir`, next to the saved model.

    Takes the arguments of `build_model_card` and returns the card.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    card = build_model_card(
        model_or_config,
        results=results,
        dataset=dataset,
        training_args=training_args,
        plot_path=plot_path,
        **card_fields,
    )
    if plot_path is not None and Path(plot_path).resolve() != (output_dir / Path(plot_path).name).resolve():
        shutil.copy(plot_path, output_dir / Path(plot_path).name)  # the card links the image by file name
    card.save(output_dir / "README.md")
    return card


__all__ = ["build_model_card", "write_model_card"]
