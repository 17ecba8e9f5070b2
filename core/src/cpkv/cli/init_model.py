"""``cpkv init-model``: write a tiny random DeepSeek-V3.2, GLM-5 or DeepSeek-V4 checkpoint (HF
format) to a directory."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("init-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--arch", type=click.Choice(["v32", "glm5", "v4"]), default=None,
              help="v32: DeepSeek-V3.2 (deepseek_v32); glm5: GLM-5 (glm_moe_dsa) with a mixed "
                   "schedule of full and shared-indexer layers; v4: DeepSeek-V4 (deepseek_v4: "
                   "sliding, CSA and HCA layers, compress rates 4 and 16, window 8, mHC, "
                   "hash-MoE) [v32; the preset's].")
@click.option("--preset", type=click.Choice(["tiny", "v32-attention", "glm5-attention",
                                             "v4-flash-attention", "v4-pro-attention"]),
              default="tiny", show_default=True,
              help="tiny: a small model for tests and CPUs; v32-attention: DeepSeek-V3.2's "
                   "attention dimensions (hidden 7168, 128 heads, latent 512 + 64, indexer "
                   "64 x 128, top-2048) in 2 dense layers with a small MLP and vocabulary "
                   "(about 0.5 GB of bf16 per layer), for GPU runs; glm5-attention: GLM-5's "
                   "(hidden 6144, 64 heads, q_lora 2048, qk_nope 192, v 256, indexer 32 x 128, "
                   "top-2048) in 2 dense layers, a full and a shared-indexer one; "
                   "v4-flash-attention / v4-pro-attention: DeepSeek-V4-Flash's / V4-Pro's "
                   "attention (head 512 = 448 + 64 rope, one KV head, 64 / 128 heads, indexer "
                   "64 x 128 top-512 / top-1024, window 128, rates 4 and 128) in a CSA and an "
                   "HCA layer with a small MoE. The size options override it.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="num_hidden_layers [3].")
@click.option("--dense-layers", type=click.IntRange(min=0), default=None,
              help="first_k_dense_replace: leading dense-MLP layers [1].")
@click.option("--hidden", type=click.IntRange(min=1), default=None, help="hidden_size [64].")
@click.option("--vocab", type=click.IntRange(min=1), default=None, help="vocab_size [512].")
@click.option("--heads", type=click.IntRange(min=1), default=None, help="num_attention_heads [4].")
@click.option("--experts", type=click.IntRange(min=2), default=None, help="n_routed_experts [8].")
@click.option("--index-topk", type=click.IntRange(min=1), default=None, help="index_topk [16].")
@click.option("--mtp/--no-mtp", default=None,
              help="Write an MTP draft layer (num_nextn_predict_layers = 1; V3.2 / GLM-5: "
                   "model.layers.{layers}.*, V4: mtp.0.*) [tiny: yes; v4 and the attention "
                   "presets: no].")
@click.option("--draft", type=click.Choice(["random", "agree"]), default="random", show_default=True,
              help="agree: scale every layer's residual branches down and build the MTP layer to "
                   "guess the target's next token (speculative decoding accepts most drafts).")
@click.option("--force", is_flag=True,
              help="Write into a non-empty DIRECTORY (replaces the checkpoint files).")
def command(directory: Path, seed: int, arch: str | None, preset: str, layers: int | None,
            dense_layers: int | None, hidden: int | None, vocab: int | None, heads: int | None,
            experts: int | None, index_topk: int | None, mtp: bool | None, draft: str,
            force: bool) -> None:
    """Write a random DeepSeek-V3.2, GLM-5 or DeepSeek-V4 checkpoint (config.json +
    model.safetensors) to DIRECTORY.

    Loadable by cpkv and by transformers' DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM /
    DeepseekV4ForCausalLM .from_pretrained.
    """
    from cpkv.models import write_tiny_checkpoint
    from cpkv.models.tiny import ARCHS, PRESETS, checkpoint_num_parameters, tiny_config

    own = next((a for a in ("glm5", "v32", "v4") if preset.startswith(a + "-")), None)
    if arch is not None and own is not None and arch != own:
        raise click.ClickException(f"{preset} is a {own} preset; --arch {arch} does not fit it")
    arch = arch or own or "v32"
    if arch == "v4" and dense_layers is not None:
        raise click.ClickException("--dense-layers does not apply to --arch v4 (every V4 layer "
                                   "is MoE)")
    base = {**ARCHS[arch], **PRESETS[preset]}
    overrides = {**base, **{k: v for k, v in {
        "num_hidden_layers": layers, "first_k_dense_replace": dense_layers, "hidden_size": hidden,
        "vocab_size": vocab, "num_attention_heads": heads, "n_routed_experts": experts,
        "index_topk": index_topk,
        "num_nextn_predict_layers": None if mtp is None else int(mtp)}.items() if v is not None}}
    if directory.exists() and any(directory.iterdir()) and not force:
        raise click.ClickException(
            f"{directory} is not empty (use --force to overwrite the checkpoint in it)")
    try:
        path = write_tiny_checkpoint(directory, seed=seed, overwrite=force, draft=draft, **overrides)
    except ValueError as exc:  # an invalid combination of sizes
        raise click.ClickException(str(exc)) from exc
    n = checkpoint_num_parameters(path)
    family = tiny_config(**overrides).family
    click.echo(f"wrote a {preset} {family} checkpoint: {n:,} parameters in {path}")
