"""The tiny random models' builder (`jaxrlhf.models.tiny.make_tiny_model`)."""

import json

from jaxrlhf.models.tiny import make_tiny_model


def test_positions_default_to_256_and_can_be_overridden(tmp_path):
    # The long-tail pipeline bench needs responses longer than the default 256 positions.
    default = json.loads((make_tiny_model(tmp_path / "a") / "config.json").read_text())
    longer = make_tiny_model(tmp_path / "b", max_position_embeddings=1024, num_hidden_layers=1)
    longer = json.loads((longer / "config.json").read_text())
    assert default["max_position_embeddings"] == 256
    assert (longer["max_position_embeddings"], longer["num_hidden_layers"]) == (1024, 1)
