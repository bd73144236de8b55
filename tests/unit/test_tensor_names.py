"""Which part of a model a weight belongs to, by name: a vision-language model's
image side goes with the input (the first rank runs it)."""

import pytest

from exo.shared.tensor_names import tensor_part


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("model.layers.3.self_attn.q_proj.weight", 3),
        ("language_model.model.layers.1.mlp.up_proj.weight", 1),
        ("model.layers.40.mlp.up_proj.weight", "unused"),  # past n_layers: an MTP layer
        ("model.embed_tokens.weight", "embedding"),
        ("model.norm.weight", "head"),
        ("lm_head.weight", "head"),
        ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "embedding"),
        ("vision_tower.transformer.layers.2.attention_norm.weight", "embedding"),
        ("multi_modal_projector.norm.weight", "embedding"),  # not the final norm
        ("multi_modal_projector.linear_1.weight", "embedding"),
        ("model.vision_tower.patch_conv.weight", "embedding"),
    ],
)
def test_a_weight_belongs_to_its_part(name: str, part: int | str) -> None:
    assert tensor_part(name, n_layers=32) == part
