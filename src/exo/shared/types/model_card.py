"""Model cards: what placement and downloads need to know about a model (built
by `exo.models.cards`)."""

from typing import Literal

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId

SizeSource = Literal["safetensors_headers", "index_total_size", "file_sizes", "config_estimate"]


class Quantization(FrozenModel):
    """The model's default affine quantization (modules may override it)."""

    bits: int
    group_size: int


class WeightFile(FrozenModel):
    """One safetensors file and which parts of the model it holds."""

    name: str
    layers: tuple[int, ...]  # sorted indices of the layers with tensors in this file
    embedding: bool  # holds input-side tensors (token embedding, vision tower)
    head: bool  # holds the final norm or the output head
    size_bytes: int | None = None  # the file's size, when known


class ModelCard(FrozenModel):
    model_id: ModelId
    architecture: str  # config.json's model_type
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    tie_word_embeddings: bool
    # Relative file names a node needs: weight files, then config/tokenizer files.
    files: tuple[str, ...]
    weight_files: tuple[WeightFile, ...]
    # Bytes of the weights as stored (tensor data, safetensors headers excluded).
    total_bytes: int
    layer_bytes: int  # one transformer layer, average over layers, rounded up
    embedding_bytes: int  # input side: token embedding (and vision tower, if any)
    head_bytes: int  # output side: final norm and lm_head (0 for lm_head when tied)
    # Parameter counts as loaded (a quantized weight counts its dequantized elements).
    layer_params: int  # average over layers, rounded up
    embedding_params: int
    head_params: int
    quantization: Quantization | None  # None: unquantized
    dtype_bytes: int  # bytes per element of the unquantized weights (2 for bf16/fp16)
    size_source: SizeSource  # exact (headers) or how the sizes were estimated

    @property
    def other_bytes(self) -> int:
        """Embedding, norm and head, as stored."""
        return self.embedding_bytes + self.head_bytes

    @property
    def metadata_files(self) -> tuple[str, ...]:
        """The files that are not weights (config, tokenizer, index)."""
        weights = {f.name for f in self.weight_files}
        return tuple(f for f in self.files if f not in weights)
